"""llama.cpp's side of benchmarks/vs_llamacpp.py; runs in the llama-cpp-python venv (it
imports nothing of starqa).

    python llamacpp_side.py save    GGUF STATE JOB.json   # context → state file on disk
    python llamacpp_side.py restore GGUF STATE JOB.json   # fresh process: load, restore, ask
    python llamacpp_side.py lookup  GGUF STATE JOB.json   # the same, decoding with
        llama-cpp-python's prompt-lookup drafts (LlamaPromptLookupDecoding, job's "lookup"
        tokens per draft): its answer to starqa's drafts
    python llamacpp_side.py prefill GGUF STATE JOB.json   # fresh process: load, evaluate
        the context, nothing saved (STATE unused): the match of `starqa ingest` (Phase 1)

    python llamacpp_side.py --smoke [GGUF]   # save, restore, lookup and prefill on a toy job

JOB.json: {"context_ids": [...], "query_ids": [...], "new_tokens": N, "threads": T,
"n_ctx": C, "flash_attn": false} (prefill reads only the context, T, C and flash_attn;
flash_attn: llama.cpp's flash attention, off where not given). Prints one JSON line of
timings (seconds) and the greedy tokens generated. llama.cpp runs on the CPU with T threads
and batches of 512 tokens; which kernels it runs follows the CPU's flags (AVX2, AVX-512
with bf16 and VNNI) and the flags it was built with (vs_llamacpp.py). --smoke runs the four
modes in turn on a few hundred token ids of a small GGUF (any: ids below 300 are in every
vocabulary; prefill with flash attention on), or says in a line why llama.cpp's side is
skipped (llama_cpp not importable, no GGUF given).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    import llama_cpp
    import numpy as np
except ImportError:  # --smoke says so in a line; the other modes stop with the reason
    llama_cpp = None


def load(gguf: str, job: dict, draft=None) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=gguf, n_ctx=job["n_ctx"], n_batch=512,
                           n_threads=job["threads"], n_threads_batch=job["threads"],
                           flash_attn=job.get("flash_attn", False),
                           # with a draft model, llama-cpp-python 0.3.36 keeps every
                           # row's logits but sizes that array by logits_all: ask for it
                           logits_all=draft is not None, verbose=False, draft_model=draft)


def last_argmax(llm: llama_cpp.Llama) -> int:
    """Greedy choice from the logits of the last token evaluated."""
    logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))


def loaded_and_prefilled(gguf: str, job: dict) -> tuple[llama_cpp.Llama, dict]:
    """The model loaded and the job's context evaluated: (the model, load_s and prefill_s)."""
    started = time.perf_counter()
    llm = load(gguf, job)
    loaded = time.perf_counter()
    llm.eval(job["context_ids"])
    return llm, {"load_s": loaded - started, "prefill_s": time.perf_counter() - loaded}


def save(gguf: str, state: str, job: dict) -> dict:
    llm, timings = loaded_and_prefilled(gguf, job)
    encoded = time.perf_counter()
    ids = job["context_ids"]
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    if not llama_cpp.llama_state_save_file(llm.ctx, state.encode(), tokens, len(ids)):
        raise SystemExit("llama_state_save_file failed")
    return {**timings, "save_s": time.perf_counter() - encoded}


def prefill(gguf: str, state: str, job: dict) -> dict:
    """A fresh process's load and prefill of the context, nothing saved (`state` unused)."""
    _, timings = loaded_and_prefilled(gguf, job)
    return {**timings, "system_info": llama_cpp.llama_print_system_info().decode()}


def restore(gguf: str, state: str, job: dict, lookup: bool = False) -> dict:
    started = time.perf_counter()
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=job["lookup"])
    llm = load(gguf, job, draft)
    loaded = time.perf_counter()
    capacity = job["n_ctx"]
    tokens = (llama_cpp.llama_token * capacity)()
    count = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_load_file(llm.ctx, state.encode(), tokens, capacity,
                                           ctypes.byref(count)):
        raise SystemExit("llama_state_load_file failed")
    llm.n_tokens = count.value
    llm.input_ids[:count.value] = np.asarray(tokens[:count.value])
    restored = time.perf_counter()
    if lookup:  # Llama.generate: the restored context is its cached prefix, the draft model
        # proposes, greedy (temp 0) picks and checks
        tokens = llm.generate(job["context_ids"] + job["query_ids"], top_k=1, temp=0.0,
                              repeat_penalty=1.0)
        generated = [next(tokens)]
        first = time.perf_counter()
        while len(generated) < job["new_tokens"]:
            generated.append(next(tokens))
    else:
        llm.eval(job["query_ids"])
        token = last_argmax(llm)
        first = time.perf_counter()
        generated = [token]
        for _ in range(job["new_tokens"] - 1):
            llm.eval([token])
            token = last_argmax(llm)
            generated.append(token)
    end = time.perf_counter()
    return {"load_s": loaded - started, "restore_s": restored - loaded,
            "question_s": first - restored,
            "decode_ms_per_token": (end - first) / max(len(generated) - 1, 1) * 1e3,
            "tokens": generated, "system_info": llama_cpp.llama_print_system_info().decode()}


MODES = {"save": save, "restore": restore, "lookup": lambda *a: restore(*a, lookup=True),
         "prefill": prefill}


def smoke(gguf: str | None) -> None:
    """save, restore, lookup and prefill (flash attention on) in turn on a toy job, each
    printing its JSON line."""
    why = ("llama_cpp is not importable by this python" if llama_cpp is None
           else "no GGUF given" if gguf is None else None)
    if why:
        print(f"llama.cpp side skipped: {why}", flush=True)
        return
    job = {"context_ids": [10 + i % 280 for i in range(300)], "query_ids": list(range(20, 32)),
           "new_tokens": 4, "threads": os.cpu_count(), "n_ctx": 512, "lookup": 3}
    with tempfile.TemporaryDirectory(prefix="llamacpp-smoke-") as tmp:
        state = str(Path(tmp) / "state.bin")
        for mode in ("save", "restore", "lookup", "prefill"):
            one = {**job, "flash_attn": mode == "prefill"}
            print(mode, json.dumps(MODES[mode](gguf, state, one)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--smoke"]:
        smoke(sys.argv[2] if len(sys.argv) > 2 else None)
        sys.exit(0)
    if llama_cpp is None:
        sys.exit("llama_cpp is not importable by this python: run it with the python of the "
                 "llama-cpp-python virtualenv (benchmarks/vs_llamacpp.py says how to make it)")
    mode, gguf, state, job_file = sys.argv[1:5]
    job = json.loads(open(job_file).read())
    print(json.dumps(MODES[mode](gguf, state, job)), flush=True)
