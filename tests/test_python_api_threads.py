"""One `LLM` used from several threads at once: the calls decode one after another, each
answer the one a lone call gives (the engine's step is not thread-safe: two calls stepped it
concurrently, giving other ids and forwards on LLaDA, a torch index error on SDAR)."""

from __future__ import annotations

import threading

import pytest

from dlm.engine.errors import UsageError
from dlm.engine.llm import LLM
from tests.tiny_families import tiny_names

PROMPTS = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(4)]
LENGTH = 32


@pytest.mark.parametrize("family", tiny_names())
def test_calls_from_several_threads_answer_as_lone_calls(family: str) -> None:
    from dlm.engine.tiny_models import ensure_tiny_model

    with LLM(ensure_tiny_model(f"tiny:{family}"), dtype="float32", device="cpu") as llm:
        alone = [(out.output_ids, out.nfe) for p in PROMPTS for out in llm.generate(p, gen_length=LENGTH)]
        for _ in range(2):  # a race: more than one chance to meet it
            answers: list[object] = [None] * len(PROMPTS)

            def run(i: int, answers: list[object] = answers) -> None:
                try:
                    out = llm.generate(PROMPTS[i], gen_length=LENGTH)[0]
                    answers[i] = (out.output_ids, out.nfe)
                except Exception as exc:  # noqa: BLE001 - the answer compared below
                    answers[i] = exc

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            assert not any(thread.is_alive() for thread in threads)
            assert answers == alone


def test_a_call_from_inside_on_step_is_refused(tiny_llada: object) -> None:
    """It would wait on the call it runs inside."""
    with LLM(tiny_llada, dtype="float32", device="cpu") as llm:  # type: ignore[arg-type]
        refused: list[BaseException] = []

        def on_step(seqs: object) -> None:
            try:
                llm.generate([5, 6], gen_length=2)
            except UsageError as exc:
                refused.append(exc)

        llm.generate([5, 6, 7], gen_length=4, on_step=on_step)
        assert refused and "inside a running generate" in str(refused[0])
        assert llm.generate([5, 6], gen_length=2)  # the lock is free again
