"""Quantized weights: the methods dlm serves, declared once (torch-free).

A method names a weight format, the devices that run it, the library class that holds and
multiplies it, and the bytes it takes. Everything else derives from this table: the
`--quantization` choices of `dlm serve` / `generate` / `batch`, the bytes `dlm estimate`
plans, the methods `dlm doctor` probes, the loader's quantization at load
(dlm/engine/quantized_weights.py) and the pre-quantized checkpoints it accepts
(dlm/engine/compressed_tensors.py).

What is quantized (`dlm.engine.quantized_weights.quantizable`): the weights of the linear
layers (attention and DeltaNet projections, dense and shared MLPs) and the routed experts.
What is not: the token embedding and the LM head (the LM head decides every token and its
probability, which orders the commits; it is read chunk by chunk by
`dlm.kernels.token_stats` exactly as without quantization), routers (routing runs in fp32),
norms, biases and the DeltaNet convolution. This is also what the compressed-tensors
releases leave out (`ignore: ["lm_head"]`).

The library is torchao (PyTorch's own). Its int8 tensor (`Int8Tensor`, weight-only, one
fp32 scale per output row) runs anywhere; its stable int4 formats need CUDA (tinygemm) or
mslk, so int4 on a CPU uses torchao's CPU int4 tensor (`Int4OpaqueTensor`, prototype
namespace: aten's `_weight_int4pack_mm_for_cpu`), group-wise asymmetric with a bf16/fp32
scale and zero per group; fp8 (`Float8Tensor`, e4m3, one fp32 scale per row) needs a GPU
with fp8 (compute capability 8.9+).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlm.engine.errors import UsageError
from dlm.engine.registry import FAMILIES, Family

# Group sizes the int4 kernels take (tinygemm), largest first: a layer takes the largest that
# divides its input features.
INT4_GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class Method:
    """One weight format. `bits`: bits per weight; `scale`: how scales are laid out
    ("row": `row_bytes` per output row, an fp32 scale and whatever else the tensor keeps;
    "group": a scale and a zero per `group_size` inputs of a row, in the activation dtype);
    `devices`: torch device types that run it; `dtypes`: activation dtypes it runs with on
    each device (absent: any)."""

    name: str
    description: str
    bits: int
    scale: str
    devices: tuple[str, ...]
    library: str  # what holds and multiplies the weight (the tensor classes: quantized_weights.quantize)
    dtypes: dict[str, tuple[str, ...]]
    min_capability: tuple[int, int] | None = None  # CUDA compute capability, where it matters
    row_bytes: int = 4
    # Per device type, the tile the kernel's layout rounds a weight up to, (rows, inputs): a
    # weight is stored padded with zeros to multiples of these (absent: (1, 1), no padding).
    tiles: dict[str, tuple[int, int]] = field(default_factory=dict)

    def stored_shape(self, rows: int, in_features: int, device: str) -> tuple[int, int]:
        """The [rows, inputs] a weight of that shape takes in this format on `device`."""
        tile_rows, tile_inputs = self.tiles.get(device, (1, 1))
        return -(-rows // tile_rows) * tile_rows, -(-in_features // tile_inputs) * tile_inputs

    def group_size(self, in_features: int) -> int | None:
        """Inputs sharing one scale in a row of `in_features` (None: the whole row); a row
        no group size divides cannot take the method."""
        if self.scale == "row":
            return in_features
        return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)

    def group_for(self, in_features: int, layer: str) -> int:
        """`group_size`, or the refusal of `layer` (the loader's and the plan's alike) when no
        group size divides its inputs."""
        group = self.group_size(in_features)
        if group is None:
            raise UsageError(
                f"--quantization {self.name} cannot quantize {layer}: its {in_features} input features are not a "
                f"multiple of any group size the kernel takes ({', '.join(map(str, INT4_GROUP_SIZES))})"
            )
        return group

    def check_split(self, in_features: int, local: int, group: int, layer: str) -> None:
        """Refuse a tensor-parallel shard of `local` of a row's `in_features` inputs that would
        cut the row's groups (a shard is quantized as the whole row is: dlm/engine/quantized_weights.py)."""
        if self.scale == "group" and local % group:
            raise UsageError(
                f"--quantization {self.name} cannot split {layer} over tensor-parallel ranks: each rank's "
                f"{local} of its {in_features} input features would cut its groups of {group}"
            )

    def weight_bytes(self, rows: int, in_features: int, act_bytes: int, device: str, group: int | None = None) -> int:
        """Bytes of one [rows, in_features] weight held in this format on `device` (data +
        scales, padding included), in groups of `group` inputs (default: the loader's choice,
        which the true inputs decide)."""
        group = group or self.group_for(in_features, f"a {rows} x {in_features} weight")
        rows, in_features = self.stored_shape(rows, in_features, device)
        data = rows * in_features * self.bits // 8
        if self.scale == "row":
            return data + rows * self.row_bytes
        return data + -(-in_features // group) * rows * 2 * act_bytes

    def bytes_per_param(self, in_features: int, act_bytes: int, device: str, group: int | None = None) -> float:
        """`weight_bytes` per weight of a layer with `in_features` inputs on `device`, input
        padding included and row padding aside, for planning from parameter counts."""
        rows = self.tiles.get(device, (1, 1))[0]
        return self.weight_bytes(rows, in_features, act_bytes, device, group) / (rows * in_features)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "int8",
            "int8 weights, one fp32 scale per output row (weight-only)",
            bits=8,
            scale="row",
            devices=("cpu", "cuda"),
            library="torchao",
            dtypes={},
            row_bytes=5,  # Int8Tensor keeps an int8 zero point (0) beside each scale
        ),
        Method(
            "int4",
            f"int4 weights, a scale and zero per group of {INT4_GROUP_SIZES[0]} inputs (weight-only)",
            bits=4,
            scale="group",
            devices=("cpu", "cuda"),
            library="torchao",
            dtypes={"cuda": ("bfloat16",)},  # tinygemm's CUDA kernel is bf16 only
            # the CPU's int4 packing takes rows in tiles of 16; torchao's CUDA tensor
            # (tinygemm) pads rows to 8 and inputs to 1024 itself (a 3584-wide layer holds 4096)
            tiles={"cpu": (16, 1), "cuda": (8, 1024)},
        ),
        Method(
            "fp8",
            "float8 e4m3 weights, one fp32 scale per output row (weight-only)",
            bits=8,
            scale="row",
            devices=("cuda",),
            library="torchao",
            dtypes={},
            min_capability=(8, 9),
        ),
    )
}

NONE = "none"
CHOICES = (NONE, *METHODS)  # what `--quantization` accepts

# The other thing a server may quantize: its requests' exact K/V caches (`--kv-cache-dtype`;
# dlm/engine/runtime/kv_cache.py). `auto`: the model's dtype; `int8`: each position's head
# vector as int8 with its own float32 scale, 1 + 4/head_dim bytes a value.
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(name: str, family: Family) -> None:
    """Refuse a K/V cache storage that is not one of `KV_CACHE_DTYPES`, or int8 for a family
    without the exact block cache it quantizes (the block-causal families'): silently
    ignored, it would promise memory the server does not save."""
    if name not in KV_CACHE_DTYPES:
        raise UsageError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name != "auto" and not family.block_causal:
        block = ", ".join(f.name for f in FAMILIES if f.block_causal)
        raise UsageError(
            f"kv_cache_dtype {name} applies to the exact block K/V cache of the block-causal families ({block}), "
            f"not {family.name}"
        )


def method_named(name: str | None) -> Method | None:
    """The method `--quantization NAME` asks for (None for none/unset); unknown names are a
    usage error listing the choices."""
    if name is None or name == NONE:
        return None
    if name not in METHODS:
        raise UsageError(f"--quantization must be one of {', '.join(CHOICES)}, got {name!r}")
    return METHODS[name]


def check_runs(method: Method, device_type: str, dtype_name: str) -> None:
    """Refuse, before any weight is read, a method this device or dtype cannot run."""
    if device_type not in method.devices:
        raise UsageError(
            f"--quantization {method.name} needs a {' or '.join(method.devices).upper()} device "
            f"({method.description}); this model runs on {device_type}"
        )
    allowed = method.dtypes.get(device_type)
    if allowed is not None and dtype_name not in allowed:
        raise UsageError(
            f"--quantization {method.name} on {device_type} runs with --dtype {' or '.join(allowed)} only "
            f"(got {dtype_name})"
        )
