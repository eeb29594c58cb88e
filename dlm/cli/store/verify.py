"""Verify a checkpoint: hashes against its manifest, safetensors structure, the shard index,
config.json's family, and the tokenizer.

Every check runs and every problem is reported with the file it concerns, because a
verification that stops at the first problem makes the operator fix them one rerun at a time.
Only what is wrong with the checkpoint is a finding (`checkpoint_fault`); a check that cannot
run here (a library that fails to import, memory, a file the process may not read) ends the
verification with an error and records nothing, so a sound version is never marked failed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dlm.cli.store.atomic import unwritable
from dlm.cli.store.hashing import ByteProgress, NoProgress, parallel_map, sha256_file
from dlm.cli.store.records import Finding, Manifest, Verification
from dlm.cli.store.safetensors_format import check_safetensors
from dlm.cli.store.store import MANIFEST, Store, iter_files, local_path, now, split_ref
from dlm.engine.errors import DlmError, InvalidConfig, UsageError

INDEX = "model.safetensors.index.json"


# The boundary between a finding (the checkpoint is at fault: recorded, the version `failed`)
# and an error (it is not: the command fails, nothing is recorded). An OSError is the file's
# own when it says the file is missing or is not one (a dangling link or a loop, a directory
# or a FIFO where a file belongs); what parsers raise on bytes they cannot read (bad UTF-8,
# JSON too deep or of the wrong types, a malformed header) is the checkpoint's too. A library
# that cannot be imported, memory running out, and every other OSError (EACCES, EPERM: the
# process may not read the store; EIO, EMFILE, ENOMEM, ...: the machine) are not, wherever in
# the exception's chain they lie (a parser's error raised while handling one); nor is anything
# else a check raises (RuntimeError, AssertionError, NameError: a fault of dlm's or of a
# library's), which ends the command as an error rather than condemning sound weights.
FILE_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO, errno.ENAMETOOLONG})
PARSE_ERRORS = (
    ValueError,  # UnicodeDecodeError, json.JSONDecodeError
    TypeError,
    LookupError,
    AttributeError,  # JSON of the wrong shape: a list where an object belongs
    RecursionError,  # nesting deeper than the parser's recursion limit
    ArithmeticError,
    EOFError,
    struct.error,
    DlmError,  # dlm's own readers' findings (read_config_json, load_tokenizer, ...)
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def environment_failure(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain that is no fault of the checkpoint's (see above), if any."""
    for link in _chain(exc):
        if isinstance(link, (ImportError, MemoryError)):
            return link
        if isinstance(link, OSError) and link.errno is not None and link.errno not in FILE_ERRNOS:
            return link
    return None


def checkpoint_fault(exc: BaseException) -> bool:
    """Whether `exc`, raised while a check read a checkpoint's files, is a finding against the
    checkpoint (recorded, the version fails) rather than an error of this environment or of
    the code (see FILE_ERRNOS above): an OSError of the file itself (an OSError without an
    errno is a library's word about the files), a parser's error or safetensors' own."""
    if isinstance(exc, CheckCouldNotRun) or environment_failure(exc) is not None:
        return False
    try:
        from safetensors import SafetensorError
    except ImportError:  # then no safetensors code raised it
        return isinstance(exc, (OSError, *PARSE_ERRORS))
    return isinstance(exc, (OSError, SafetensorError, *PARSE_ERRORS))


class CheckCouldNotRun(DlmError):
    """A check met an exception that is no fault of the checkpoint's (`checkpoint_fault`): the
    verification ends with this error (exit 1) and records nothing."""


def not_the_checkpoints(where: str, check: str, exc: BaseException) -> CheckCouldNotRun:
    """The error (exit 1) for an exception of check `check` on `where` that is not a finding."""
    cause = environment_failure(exc) or exc
    return CheckCouldNotRun(
        f"could not verify {where}: its {check} check failed with {type(cause).__name__}: "
        f"{str(cause)[:200] or '(no message)'}; that says nothing about the checkpoint, so nothing was "
        "recorded (fix the cause and run it again)"
    )


def finding(where: Path, check: str, exc: BaseException) -> str:
    """What to record of `exc`, met by check `check` on `where`, when it is the checkpoint's
    fault; else raises the error (`not_the_checkpoints`) instead."""
    if not checkpoint_fault(exc):
        raise not_the_checkpoints(str(where), check, exc) from exc
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


@dataclass
class VerifyReport:
    path: str
    model: str | None = None
    version: str | None = None
    files: int = 0
    bytes_hashed: int = 0
    hash_seconds: float = 0.0
    seconds: float = 0.0
    family: str | None = None
    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, file: str, check: str, problem: str) -> None:
        self.failures.append(Finding(file=file, check=check, problem=problem))

    def warn(self, file: str, check: str, problem: str) -> None:
        self.warnings.append(Finding(file=file, check=check, problem=problem))

    def to_json(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "failures": [f.to_json() for f in self.failures],
            "warnings": [f.to_json() for f in self.warnings],
            "ok": self.ok,
        }

    def record(self, hashed: bool) -> Verification:
        """What the manifest keeps of this verification."""
        return Verification(
            ok=self.ok,
            at=now(),
            hashed=hashed,
            family=self.family,
            failures=list(self.failures),
            warnings=list(self.warnings),
        )


def check_no_links(directory: Path, report: VerifyReport) -> None:
    """A store version's files are its own: a fetch copies them (or hard-links them), never
    makes a symbolic link. A link (the `files` directory itself, a file or a directory in it)
    hashes as whatever it points to now, which can change or vanish while the version stays
    "verified", and `dlm rm` does not remove it: each is a finding, naming its target."""

    def fail(path: Path, rel: str) -> None:
        report.fail(rel, "manifest", f"a symbolic link to {os.readlink(path)}: a store version holds its own files")

    if directory.is_symlink():
        fail(directory, ".")
        return
    for root, dirs, files in os.walk(directory):
        for name in sorted([*dirs, *files]):
            path = Path(root) / name
            if path.is_symlink():
                fail(path, path.relative_to(directory).as_posix())


def check_hashes(
    directory: Path, manifest: Manifest, report: VerifyReport, progress: ByteProgress, workers: int | None
) -> None:
    """Every manifest file exists with its size and sha256; no file is unaccounted for; and
    none is a symbolic link (`check_no_links`)."""
    check_no_links(directory, report)
    listed = {f.path: f for f in manifest.files}
    present = {p.relative_to(directory).as_posix(): p for p in iter_files(directory)}
    for rel in sorted(set(present) - set(listed)):
        report.fail(rel, "manifest", "file is not in the manifest")
    to_hash: list[Path] = []
    for rel, entry in sorted(listed.items()):
        path = present.get(rel)
        if path is None:
            report.fail(rel, "manifest", "file is missing")
            continue
        try:
            size = path.stat().st_size
        except OSError as exc:  # a dangling link, a file gone mid-check: a finding, never a crash
            report.fail(rel, "manifest", f"unreadable: {finding(directory, 'sha256', exc)}")
            continue
        if size != entry.size:
            report.fail(rel, "size", f"{size} bytes, the manifest says {entry.size} (truncated or replaced)")
            continue
        to_hash.append(path)
    start = time.perf_counter()
    results = parallel_map(lambda p, adv: sha256_file(p, adv), to_hash, progress, "hashing", workers)
    report.hash_seconds = time.perf_counter() - start
    for path, digest in results.items():
        rel = path.relative_to(directory).as_posix()
        report.bytes_hashed += listed[rel].size
        if isinstance(digest, OSError):
            finding(directory, "sha256", digest)
            report.fail(rel, "sha256", f"unreadable: {digest}")
        elif digest != listed[rel].sha256:
            report.fail(
                rel, "sha256", f"sha256 {digest[:16]}... differs from the manifest's {listed[rel].sha256[:16]}..."
            )


def _load_index(path: Path, report: VerifyReport) -> dict[str, str] | None:
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                duplicates.append(key)
            seen[key] = value
        return seen

    try:
        raw = json.loads(path.read_text(), object_pairs_hook=pairs)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.fail(INDEX, "index", f"not valid JSON: {exc}")
        return None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        report.fail(INDEX, "index", "has no weight_map of tensor name -> shard file")
        return None
    for name in duplicates:
        report.fail(INDEX, "index", f"names tensor {name} more than once")
    return weight_map


def weight_files(directory: Path) -> list[Path]:
    """The `*.safetensors` files every check reads: regular files only (reading a FIFO put in
    a shard's place blocks until a writer comes; `check_weights` reports it)."""
    return [p for p in iter_files(directory) if p.suffix == ".safetensors" and p.is_file()]


def check_weights(directory: Path, report: VerifyReport) -> None:
    """safetensors structure of every shard, and the index against the shards' headers."""
    for path in iter_files(directory):
        if path.suffix == ".safetensors" and path.exists() and not path.is_file():
            report.fail(path.relative_to(directory).as_posix(), "safetensors", "not a regular file")
    shards = {p.relative_to(directory).as_posix(): p for p in weight_files(directory)}
    if not shards:
        report.fail(".", "safetensors", "no *.safetensors weights")
        return
    holders: dict[str, list[str]] = {}
    for rel, path in sorted(shards.items()):
        try:
            result = check_safetensors(path)
        except OSError as exc:  # a dangling link or a looping one
            report.fail(rel, "safetensors", f"unreadable: {finding(directory, 'safetensors', exc)}")
            continue
        for problem in result.problems:
            report.fail(rel, "safetensors", problem)
        for tensor in result.tensors:
            holders.setdefault(tensor, []).append(rel)
    for tensor, files in sorted(holders.items()):
        if len(files) > 1:
            report.fail(files[1], "safetensors", f"tensor {tensor} is also in {files[0]}")
    index = directory / INDEX
    if not index.exists():
        return
    if not index.is_file():  # passed as "no index" before, though every loader refuses it
        report.fail(INDEX, "index", "not a regular file")
        return
    weight_map = _load_index(index, report)
    if weight_map is None:
        return
    for tensor, shard in sorted(weight_map.items()):
        if shard not in shards:
            report.fail(INDEX, "index", f"names shard {shard} (for {tensor}), which is missing")
        elif shard not in holders.get(tensor, []):
            report.fail(INDEX, "index", f"maps tensor {tensor} to {shard}, which does not hold it")
    for tensor, files in sorted(holders.items()):
        if tensor not in weight_map:
            report.fail(files[0], "index", f"holds tensor {tensor}, which the index does not name")


def check_config(directory: Path, report: VerifyReport) -> None:
    """config.json and the generation_config.json beside it, read as every command reads
    them; a problem is recorded against the file that holds it."""
    from dlm.engine.config import load_config

    try:
        report.family = load_config(directory).family
    except DlmError as exc:
        file = exc.file if isinstance(exc, InvalidConfig) else "config.json"
        report.fail(file, "config", finding(directory, "config", exc))


def check_quantization(directory: Path, report: VerifyReport) -> None:
    """A pre-quantized checkpoint (compressed-tensors): a scheme dlm serves, and for every
    quantized layer its data and scales present, of the right dtypes and shapes (headers),
    and scales finite and positive (read: they are small)."""
    from safetensors import safe_open

    from dlm.engine import compressed_tensors as ct
    from dlm.engine.config import read_config_json
    from dlm.engine.utf8_paths import utf8_path

    try:
        scheme = ct.read_scheme(read_config_json(directory))
    except DlmError as exc:
        report.fail("config.json", "quantization", finding(directory, "quantization", exc))
        return
    if scheme is None:
        return
    files = {p: p.relative_to(directory).as_posix() for p in weight_files(directory)}
    headers, holder = {}, {}
    for path in files:
        for name, header in ct.read_headers([path]).items():
            headers[name], holder[name] = header, path
    for tensor, problem in ct.header_problems(headers, scheme):
        report.fail(files.get(holder.get(tensor, directory), "."), "quantization", problem)

    def read(name: str) -> Any:
        with utf8_path(holder[name]) as readable, safe_open(readable, framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    for tensor, problem in ct.value_problems(read, headers):
        report.fail(files[holder[tensor]], "quantization", problem)


def check_tokenizer(directory: Path, report: VerifyReport) -> None:
    from dlm.engine.tokenizer import has_tokenizer, load_tokenizer

    if not has_tokenizer(directory):
        report.warn(".", "tokenizer", "no tokenizer files: only token-id prompts will work")
        return
    try:
        load_tokenizer(directory)
    except DlmError as exc:
        report.fail("tokenizer", "tokenizer", finding(directory, "tokenizer", exc))


def check_tensors(directory: Path, report: VerifyReport) -> None:
    """The weights hold tensors, and, for the family config.json names, every tensor its
    model reads: the engine's own model is built on the meta device (no storage, no weight
    read) and its loader says which checkpoint names it needs (`missing_tensors`), so a
    checkpoint that verifies is one `dlm serve` can load, not one that fails at the first
    request to start."""
    shards = weight_files(directory)
    if not shards:
        return  # check_weights has said so
    names: set[str] = set()
    for shard in shards:
        try:
            names.update(check_safetensors(shard).tensors)
        except OSError as exc:
            finding(directory, "tensors", exc)
            continue  # check_weights has said so
    if not names:
        report.fail(".", "tensors", "the safetensors files hold no tensors")
        return
    if report.family is None:
        return  # no family to hold them against; check_config has said why
    from dlm.engine.compressed_tensors import quantized_layers, read_headers
    from dlm.engine.config import load_config
    from dlm.engine.loader import missing_tensors, shape_mismatches

    shapes, holder = {}, {}
    for shard in shards:
        for tensor, header in read_headers([shard]).items():
            shapes[tensor], holder[tensor] = header.shape, shard.relative_to(directory).as_posix()
    # A pre-quantized layer's `weight` is decoded from its integers and scales (check_quantization).
    names |= {f"{layer}.weight" for layer in quantized_layers(read_headers(shards))}
    from dlm.engine.config import check_fits_weights
    from dlm.engine.runtime.engine import build_on_meta

    config = load_config(directory)
    try:
        check_fits_weights(config, sum(math.prod(shape) for shape in shapes.values()))
    except InvalidConfig as exc:
        report.fail("config.json", "config", finding(directory, "config", exc))
        return
    model = build_on_meta(config)
    missing = missing_tensors(model, names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        report.fail(".", "tensors", f"lacks tensor {missing[0]}{more}, which the {report.family} model reads")
    by_file: dict[str, list[str]] = {}
    for tensor, problem in shape_mismatches(model, {name: shapes[name] for name in names if name in shapes}):
        by_file.setdefault(holder[tensor], []).append(problem)
    for file, problems in sorted(by_file.items()):
        more = f" (and {len(problems) - 1} more in this file)" if len(problems) > 1 else ""
        report.fail(file, "tensors", f"{problems[0]} of config.json's {report.family} model{more}")


STRUCTURE_CHECKS = (
    ("safetensors", ".", check_weights),
    ("config", "config.json", check_config),
    ("quantization", "config.json", check_quantization),
    ("tensors", ".", check_tensors),  # after config: it needs the family
    ("tokenizer", "tokenizer", check_tokenizer),
)


def check_structure(directory: Path, report: VerifyReport) -> None:
    """The checks that need no manifest. Each parses files of unknown origin, so what a parser
    raises on them (bad encodings, nesting deeper than the parser's recursion limit, a
    directory where a file belongs, wrong JSON types) is a finding against that check, not a
    crash. What says nothing about the files (`checkpoint_fault`: an import that fails, memory,
    a permission, an error in the code) is no finding: DlmError (exit 1), and the caller
    records nothing, so a sound checkpoint is never marked failed for the machine's trouble."""
    for check, file, run in STRUCTURE_CHECKS:
        try:
            run(directory, report)
        except CheckCouldNotRun:
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary with untrusted files, see above
            finding(directory, check, exc)
            report.fail(file, check, f"could not be read: {type(exc).__name__}: {str(exc)[:200]}")


def verify_directory(
    directory: Path,
    manifest: Manifest | None = None,
    progress: ByteProgress | None = None,
    workers: int | None = None,
) -> VerifyReport:
    """All checks on a checkpoint directory; hashes only when there is a manifest to hold
    them against."""
    start = time.perf_counter()
    report = VerifyReport(path=str(directory))
    report.files = sum(1 for _ in iter_files(directory))
    if manifest is not None:
        report.model, report.version = manifest.name, manifest.version
        check_hashes(directory, manifest, report, progress or NoProgress(), workers)
    else:
        report.warn(".", "manifest", "not a store version: hashes not checked")
    check_structure(directory, report)
    report.seconds = time.perf_counter() - start
    return report


def verify_model(
    spec: str, store: Store, progress: ByteProgress | None = None, workers: int | None = None
) -> VerifyReport:
    """Verify MODEL: a checkpoint directory (`tiny:FAMILY` too, as every command names one),
    or a store version (whose manifest then records the result, so `release` knows whether it
    may use it)."""
    from dlm.cli.store.releases import transaction
    from dlm.engine.tiny_models import ensure_tiny_model, is_tiny

    if is_tiny(spec):  # built on first use, as generate, serve and estimate build it
        return verify_directory(ensure_tiny_model(spec), None, progress, workers)
    path = local_path(spec)
    if path is not None and path.is_dir():
        return verify_directory(path, None, progress, workers)
    if path is not None:
        raise UsageError(f"{spec} is a file; MODEL is a checkpoint directory or a store NAME[@VERSION]")
    try:
        split_ref(spec)
    except UsageError:
        raise UsageError(f"no such directory: {spec} (nor is it a store NAME[@VERSION])") from None
    manifest = store.find(spec)
    report = verify_directory(store.files_dir(manifest.name, manifest.version), manifest, progress, workers)
    try:
        with transaction(store):
            store.record_verification(manifest, report.record(hashed=True))
    except OSError as exc:  # a read-only store (a mount, another user's) is checked all the same
        if not unwritable(exc):
            raise
        report.warn(MANIFEST, "manifest", f"result not recorded: the store cannot be written ({exc.strerror})")
    return report
