"""`dlm serve --decode-mode`: the server-wide default decoding mode (guide 003's
`default_mode: diffusion|autoregressive`), the mode of every request that sends no
`decode_mode`; a request's own wins, and a family that cannot decode that way refuses it at
start (exit 2), from its record, for every family the registry lists. And guide 003's
dual-mode acceptance: `dlm validate`'s `capability_decode_mode` on a real server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dlm.cli.main import app
from dlm.cli.server.config import ServeConfig, load_config
from dlm.engine.config import load_config as model_config
from dlm.engine.errors import UsageError
from dlm.engine.params import DEFAULTS, MODES
from dlm.engine.registry import family_named
from dlm.engine.tiny_models import ensure_tiny_model
from tests.serving import in_process_server
from tests.tiny_families import tiny_names


def takes_ar(name: str) -> bool:
    """What the family record says: `ar` is one token per forward over a block cache."""
    return family_named(model_config(ensure_tiny_model(name)).family).block_causal


def test_the_setting_is_a_flag_a_file_key_and_a_variable(tmp_path: Path) -> None:
    assert ServeConfig().decode_mode == DEFAULTS["mode"] == "diffusion"
    settings = tmp_path / "serve.yaml"
    settings.write_text("decode-mode: ar\n")
    assert load_config(settings, environ={}).decode_mode == "ar"
    assert load_config(environ={"DLM_DECODE_MODE": "ar"}).decode_mode == "ar"
    assert load_config(environ={"DLM_DECODE_MODE": "ar"}, flags={"decode_mode": "diffusion"}).decode_mode == "diffusion"
    with pytest.raises(UsageError, match=f"invalid setting decode_mode: must be one of {', '.join(MODES)}"):
        load_config(flags={"decode_mode": "autoregressive"}, environ={})


def test_it_is_the_default_of_requests_that_send_none() -> None:
    config = ServeConfig(decode_mode="ar")
    assert config.decoding_params({}).mode == "ar"
    assert config.decoding_params({"mode": "diffusion"}).mode == "diffusion"  # the request's own wins
    assert ServeConfig().decoding_params({}).mode == "diffusion"


@pytest.mark.parametrize("name", [f"tiny:{n}" for n in tiny_names()])
def test_a_family_that_cannot_decode_that_way_refuses_it_at_start(name: str) -> None:
    """From config.json, before any weight loads: as `--block-length` on Clover."""
    model = model_config(ensure_tiny_model(name))
    for mode in MODES:
        config = ServeConfig(model=name, decode_mode=mode)
        if mode == "diffusion" or takes_ar(name):
            config.check_model(model)
            continue
        with pytest.raises(UsageError, match="a default this server gives requests is refused: mode 'ar'") as exc:
            config.check_model(model)
        assert exc.value.exit_code == 2


def test_dlm_serve_exits_2_naming_it() -> None:
    result = CliRunner().invoke(app, ["serve", "tiny:llada", "--decode-mode", "ar", "--port", "0"])
    assert result.exit_code == 2, result.output
    assert "mode 'ar' is not available for llada models" in result.output


def test_what_serve_could_not_check_before_loading_fails_the_load() -> None:
    """A deployment's release (and the transformers backend) is checked once loaded: the
    server's load fails with exit code 2, as a hot swap to such a release fails."""
    from dlm.cli.server.service import Service

    service = Service(load_config(None, {"model": "tiny:llada", "decode_mode": "ar", "warmup": False}, environ={}))
    service.load()
    assert service.served is None and service.exit_code == 2
    assert "mode 'ar' is not available for llada models" in str(service.load_error)


def complete(client: Any, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", [f"tiny:{n}" for n in tiny_names() if takes_ar(f"tiny:{n}")][:1])
def test_requests_decode_in_the_servers_mode_unless_they_say(name: str) -> None:
    """With one denoising step per block by default, diffusion spends a few forwards on 16
    tokens; ar one per token: which one a request got shows in its usage."""
    with in_process_server(model=name, warmup=False, decode_mode="ar", refinement_steps=1) as client:
        default = complete(client)
        ar = complete(client, decode_mode="ar")
        diffusion = complete(client, decode_mode="diffusion")
    assert default["choices"] == ar["choices"] and default["usage"] == ar["usage"]
    assert ar["usage"]["denoising_steps"] >= 16 > diffusion["usage"]["denoising_steps"]


@pytest.mark.parametrize(
    "name",
    [next(f"tiny:{n}" for n in tiny_names() if takes_ar(f"tiny:{n}") is takes) for takes in (True, False)],
)
def test_validate_compares_the_modes_where_the_family_takes_both(name: str) -> None:
    """`/v1/models` lists `decode_mode` for a family that takes `ar` (from its record), and
    `capability_decode_mode` then passes; elsewhere it is skipped, saying why."""
    from dlm.cli.checks.runner import PASSED, SKIPPED, Context, ValidateOptions, run_checks
    from dlm.cli.checks.validate import validation_checks
    from dlm.cli.client.api import ApiClient

    wanted = ("models", "completion", "usage", "capability_decode_mode")
    with in_process_server(model=name, warmup=False) as http:
        advertised = "decode_mode" in http.get("/v1/models").json()["data"][0]["capabilities"]
        api = ApiClient("http://dlm")
        api.http = http
        checks = [c for c in validation_checks() if c.name in wanted]
        results = {r.name: r for r in run_checks(Context(api, ValidateOptions()), checks)}
    assert advertised is takes_ar(name)
    check = results["capability_decode_mode"]
    if advertised:
        assert check.status == PASSED and check.detail.startswith("diffusion 16 tokens"), check.detail
        assert "; ar 16 tokens in " in check.detail
    else:
        assert (check.status, check.detail) == (SKIPPED, "the server does not advertise decode_mode")


@pytest.mark.parametrize("name", [f"tiny:{n}" for n in tiny_names() if takes_ar(f"tiny:{n}")][:1])
def test_validate_checks_the_diffusion_fields_of_a_server_whose_default_is_ar(name: str) -> None:
    """`dlm serve tiny:sdar --decode-mode ar` refuses steps, threshold and block_length sent
    without a mode; validate's checks of them were skipped, saying 'the server refuses steps as
    unsupported', though it takes them beside decode_mode diffusion, which it advertises."""
    from dlm.cli.checks.runner import PASSED, Context, ValidateOptions, run_checks
    from dlm.cli.checks.validate import validation_checks
    from dlm.cli.client.api import ApiClient

    wanted = ("models", "completion", "steps", "threshold", "block_length")
    with in_process_server(model=name, warmup=False, decode_mode="ar") as http:
        api = ApiClient("http://dlm")
        api.http = http
        checks = [c for c in validation_checks() if c.name in wanted]
        results = {r.name: r for r in run_checks(Context(api, ValidateOptions()), checks)}
    for check in ("steps", "threshold", "block_length"):
        assert results[check].status == PASSED, (check, results[check].detail)
