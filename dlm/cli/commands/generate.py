"""`dlm generate`: decode one prompt with the engine and print the result."""

from __future__ import annotations

from dataclasses import replace

import typer

from dlm.cli import parallel as tp
from dlm.cli import params as dp
from dlm.cli.model_options import MODEL_ARGUMENT
from dlm.cli.output import cli_errors, emit_json, err_console, progress
from dlm.cli.setting_options import setting_option


def _generate_with_canvas(llm, prompt_tokens: list[int], params):  # noqa: ANN001, ANN202
    """Decode, printing each sample's canvas after every denoising step as one JSON line on
    stdout (the shape of the server's canvas events, docs/serve.md)."""
    import json

    from dlm.engine.runtime.request import canvas_json
    from dlm.engine.tokenizer import has_tokenizer

    text = (lambda token: llm.tokenizer.decode([token])) if has_tokenizer(llm.model_dir) else None

    def on_step(seqs) -> None:  # noqa: ANN001
        for index, seq in enumerate(seqs):  # the n samples of the prompt, as the server's choices
            canvas = {"index": index, **canvas_json(seq.nfe, seq.canvas_view(), text)}
            typer.echo(json.dumps({"canvas": canvas}, ensure_ascii=False))

    return llm.generate(prompt_tokens, params, on_step=on_step)


def _generate_with_progress(llm, prompt_tokens: list[int], params):  # noqa: ANN001, ANN202
    """Decode (the `n` samples) with a progress bar of committed tokens on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("denoising"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TextColumn("{task.fields[nfe]} forwards"),
        TimeElapsedColumn(),
    )
    with progress(*columns) as bar:
        task = bar.add_task("denoising", total=params.gen_length * params.n, nfe=0)

        def on_step(seqs) -> None:  # noqa: ANN001
            left = sum(seq.masks_left for seq in seqs)
            bar.update(task, completed=params.gen_length * params.n - left, nfe=max(s.nfe for s in seqs))

        return llm.generate(prompt_tokens, params, on_step=on_step)


def _logprobs(out) -> list[dict] | None:  # noqa: ANN001
    """--json's log-probabilities: per completion token, at the step that committed it."""
    if out.logprobs is None:
        return None
    return [{"token": t.token, "logprob": t.logprob, "top": [list(pair) for pair in t.top]} for t in out.logprobs]


def _sample(out) -> dict:  # noqa: ANN001
    """What differs between the `--n` samples of one prompt."""
    return {
        "index": out.index,
        "output_ids": out.output_ids,
        "completion_ids": out.completion_ids,
        "text": out.text,
        "nfe": out.nfe,
        "finish_reason": out.finish_reason,
        "logprobs": _logprobs(out),
    }


def generate(
    ctx: typer.Context,
    model: str | None = MODEL_ARGUMENT,
    prompt: str | None = typer.Option(
        None,
        "--prompt",
        "-p",
        help="Text prompt (uses the checkpoint's tokenizer); - reads it from standard input (one final newline "
        "dropped).",
        show_default="none",
    ),
    prompt_ids: str | None = typer.Option(
        None, "--prompt-ids", help="Prompt as comma-separated token ids.", show_default="none"
    ),
    chat: bool = typer.Option(False, "--chat", help="Wrap the text prompt in the tokenizer's chat template."),
    chat_template_kwargs: str | None = typer.Option(
        None,
        "--chat-template-kwargs",
        help="With --chat: extra chat-template variables as a JSON object ('{\"enable_thinking\": true}'), "
        "as a chat request's chat_template_kwargs.",
        show_default="none",
    ),
    suffix_text: str | None = typer.Option(
        None,
        "--suffix",
        help="Infilling: text after the answer, which is decoded between the prompt and it "
        "(bidirectional families: LLaDA, Dream).",
        show_default="none",
    ),
    suffix_ids: str | None = typer.Option(
        None, "--suffix-ids", help="The suffix as comma-separated token ids.", show_default="none"
    ),
    gen_length: int = dp.option("gen_length"),
    steps: int | None = dp.option("steps"),
    refinement_steps: int | None = dp.option("refinement_steps"),
    block_length: int | None = dp.option("block_length"),
    remasking: str = dp.option("remasking"),
    threshold: float | None = dp.option("threshold"),
    factor: float | None = dp.option("factor"),
    cfg_scale: float = dp.option("cfg_scale"),
    drafts: int = dp.option("drafts"),
    temperature: float = dp.option("temperature"),
    seed: int | None = dp.option("seed"),
    cache: str = dp.option("cache"),
    alg: str | None = dp.option("alg"),
    alg_temp: float | None = dp.option("alg_temp"),
    top_p: float | None = dp.option("top_p"),
    top_k: int | None = dp.option("top_k"),
    edit_threshold: float | None = dp.option("edit_threshold"),
    edit_mode: str | None = dp.option("edit_mode"),
    max_post_edit_steps: int | None = dp.option("max_post_edit_steps"),
    stop_token_ids: list[str] | None = dp.option("stop_token_ids"),
    stop: list[str] | None = dp.option("stop"),
    early_stop: bool = dp.option("early_stop"),
    ignore_eos: bool = dp.option("ignore_eos"),
    min_tokens: int = dp.option("min_tokens"),
    n: int = dp.option("n"),
    logprobs: int | None = dp.option("logprobs"),
    mode: str = dp.option("mode"),
    entropy_bound: float | None = dp.option("entropy_bound"),
    min_temperature: float | None = dp.option("min_temperature"),
    max_temperature: float | None = dp.option("max_temperature"),
    stability_threshold: int | None = dp.option("stability_threshold"),
    confidence_threshold: float | None = dp.option("confidence_threshold"),
    response_format: str | None = dp.option("response_format"),
    dtype: str = setting_option("dtype"),
    device: str = setting_option("device"),
    quantization: str | None = setting_option("quantization"),
    kv_cache_dtype: str = setting_option("kv_cache_dtype"),
    thread_governor: bool | None = setting_option("thread_governor"),
    backend: str = setting_option("backend"),
    trust_remote_code: bool = setting_option("trust_remote_code"),
    tensor_parallel_size: int | None = tp.TENSOR_PARALLEL_SIZE,
    nnodes: int | None = tp.NNODES,
    node_rank: int | None = tp.NODE_RANK,
    master_addr: str | None = tp.MASTER_ADDR,
    master_port: int | None = tp.MASTER_PORT,
    moe_parallel: str | None = tp.MOE_PARALLEL,
    json_out: bool = typer.Option(False, "--json", help="Print a JSON result on stdout."),
    canvas: bool = typer.Option(
        False,
        "--canvas",
        help="Print the canvas after every denoising step (committed, provisional and masked positions) "
        "as JSON lines on stdout before the result.",
    ),
) -> None:
    """Generate text (or token ids) from MODEL by masked-diffusion decoding."""
    with cli_errors():
        from dlm.cli.store.leases import holding

        with holding("dlm generate"):  # a store version it resolves is leased while it runs
            from dlm.engine.errors import UsageError

            source: str | list[int]  # the prompt: text (encoded once the tokenizer is loaded) or token ids
            if prompt == "-" and prompt_ids is None:  # `dlm generate -p - < prompt.txt`, or from a pipe
                from dlm.cli.text_files import read_stdin

                text = read_stdin("the prompt")  # its final newline dropped, a Windows one (CRLF) too
                source = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
            elif prompt is not None and prompt_ids is None:
                source = prompt
            elif prompt_ids is not None and prompt is None:
                source = dp.parse_ids(prompt_ids, "--prompt-ids")
            else:
                raise UsageError("give exactly one of --prompt or --prompt-ids")
            if suffix_text is not None and suffix_ids is not None:
                raise UsageError("give --suffix or --suffix-ids, not both")
            template_kwargs = dp.template_kwargs(chat_template_kwargs, chat)
            from dlm.cli.store.resolve import resolve_model

            checkpoint = resolve_model(model)  # fails fast; also resolves store names
            model = str(checkpoint)
            params = dp.decoding_params(ctx.params)
            if suffix_ids is not None:  # text is encoded once the tokenizer is loaded
                params = replace(params, suffix=tuple(dp.parse_ids(suffix_ids, "--suffix-ids")))
            parallel = tp.parallel_config(
                tensor_parallel_size, nnodes, node_rank, master_addr, master_port, moe_parallel
            )
            if backend == "native":  # a text prompt's length is known once tokenised; a text suffix has a token
                early = replace(params, suffix=params.suffix or ((0,) if suffix_text else ()))
                dp.check_before_loading(
                    checkpoint, early, len(source) if isinstance(source, list) else None, parallel.tensor_parallel_size
                )

            from dlm.engine.llm import LLM

            if tp.run_worker(  # another node's rank
                model, dtype, device, parallel, quantization=quantization, kv_cache_dtype=kv_cache_dtype
            ):
                return
            with err_console.status("loading model"):
                llm = LLM(
                    model,
                    dtype=dtype,
                    device=device,
                    backend=backend,
                    trust_remote_code=trust_remote_code,
                    parallel=parallel,
                    quantization=quantization,
                    thread_governor=thread_governor,
                    kv_cache_dtype=kv_cache_dtype,
                )
            with llm:  # stops the worker ranks of a tensor-parallel model however this ends
                if llm.engine.tensor_parallel_size > 1:
                    err_console.print(f"[dim]tensor parallel: {llm.engine.tensor_parallel_size} ranks ready[/]")
                if llm.thread_governor_off is not None:
                    err_console.print(f"thread governor: off ({llm.thread_governor_off})")
                path = llm.engine.path
                if path is not None:
                    from dlm.engine.transformers_backend import PATHS

                    err_console.print(f"[dim]transformers backend, {path} path: {PATHS[path]}[/]")
                # Validate before decoding so a bad flag fails fast, not after tokenizer work.
                prompt_tokens = llm.encode(source, chat=chat, chat_template_kwargs=template_kwargs)
                if suffix_text:
                    params = replace(params, suffix=tuple(llm.encode(suffix_text)))
                resolved = llm.engine.validate(params, len(prompt_tokens))
                decode = _generate_with_canvas if canvas else _generate_with_progress
                outs = decode(llm, prompt_tokens, resolved)
                out = outs[0]
                if json_out:
                    emit_json(
                        {
                            "model": str(llm.model_dir),
                            "prompt_ids": out.prompt_ids,
                            "output_ids": out.output_ids,
                            "completion_ids": out.completion_ids,
                            "text": out.text,
                            "nfe": out.nfe,
                            "seconds": round(out.seconds, 6),
                            "tokens_per_second": round(out.tokens_per_second, 3),
                            "finish_reason": out.finish_reason,
                            "query_lengths": out.query_lengths,
                            "cache": out.cache,
                            "tokens_fed": sum(out.query_lengths),
                            "params": dict(resolved.__dict__),
                            "dtype": str(llm.dtype).replace("torch.", ""),
                            "quantization": llm.quantization,
                            "kv_cache_dtype": llm.engine.loaded.kv_cache_dtype,  # as /health reports it
                            "device": str(llm.device),
                            "backend": {"name": backend, "path": path},
                            "tensor_parallel_size": llm.engine.tensor_parallel_size,
                            "logprobs": _logprobs(out),
                            **({"samples": [_sample(o) for o in outs]} if len(outs) > 1 else {}),
                        }
                    )
                    return
                for o in outs:
                    if len(outs) > 1:
                        err_console.print(f"[dim]sample {o.index}[/]")
                    typer.echo(o.text if o.text is not None else ",".join(map(str, o.output_ids)))
                err_console.print(
                    f"[dim]{len(out.output_ids)} tokens, {out.nfe} forwards feeding {sum(out.query_lengths)} tokens "
                    f"(cache {out.cache}), {out.seconds:.2f}s ({out.tokens_per_second:.1f} tok/s), "
                    f"finish_reason={out.finish_reason}[/]"
                )
                if llm.dtype_choice.requested == "auto":
                    err_console.print(f"[dim]dtype {llm.dtype_choice.name} (auto: {llm.dtype_choice.reason})[/]")
                if llm.quantization is not None:
                    err_console.print(f"[dim]weights: {llm.quantization} (docs/quantization.md)[/]")
