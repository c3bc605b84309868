"""The bundled engine side by side with vLLM's CPU backend, or with transformers without it.

    python bench/engine_vs_vllm.py                       # SmolLM2-135M shape, float32 + bf16
    python bench/engine_vs_vllm.py --model DIR           # a real checkpoint folder
    python bench/engine_vs_vllm.py --base 9bd452d        # also the engine as of that commit
    python bench/engine_vs_vllm.py --vllm-python /work/vllm-venv/bin/python
    python bench/engine_vs_vllm.py --quick               # small smoke run

Each contender runs in its own worker process (same thread count, one active at a time)
and the parent alternates their order request by request (A B, then B A), so load from
anything else on the machine falls on all of them alike. Measured per dtype: cold TTFT of
an uncached prompt, warm TTFT of a prompt sharing all but its last ~25 tokens with the one
before, decode tokens/s at batch 1 and 8 (timed inside the worker from every request's
first token to the end; for vLLM, whose offline API shows only the end, a run of N + 1
tokens minus a run of 1), and greedy equality on five prompts (64 tokens each).

vLLM is used when `--vllm-python` (or this interpreter) can import it; otherwise the bench
says so and compares with transformers, which has no prefix cache (its warm TTFT is a
cold one). vLLM runs with the CPU platform forced (`VLLM_TARGET_DEVICE=cpu`), OpenMP left
unbound at `--threads` threads like the engine (`VLLM_CPU_OMP_THREADS_BIND=nobind`; its
automatic binding keeps a core for its scheduler, one thread on a 2-core machine), a KV
cache as large as the engine's, and detokenization off (the engine's worker returns ids).
Its first start compiles the model with torch.compile (minutes on 2 cores; cached after).

Without `--model` the checkpoint is bench/smollm2_checkpoint.py's: SmolLM2-135M-Instruct's
exact shape and a tokenizer of its full vocabulary, with seeded random weights whose
embeddings, attention and final norm are drawn so that the top logit leads by a margin
and the answer depends on the context (see that module's docstring: with a plain 0.02
init the top logits are near ties and greedy equality would measure rounding, not
correctness). No download anywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_TIMEOUT_S = 900.0  # no single request to a worker may take longer
# vLLM's first start compiles the model (about 4 minutes on 2 busy cores; cached after).
WORKER_START_TIMEOUT_S = 1200.0


# -- workers (each in its own process, possibly another interpreter) ----------------------


def engine_blocks(max_len: int) -> int:
    """The engine worker's KV pool in 16-token blocks: 8 prompts of max_len, and some."""
    return (8 * max_len) // 16 + 64


def engine_kv_bytes(model: str, dtype: str, max_len: int) -> int:
    """Bytes of the engine worker's KV pool, so vLLM is given the same."""
    with open(os.path.join(model, "config.json")) as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim
    element = 4 if dtype == "float32" else 2
    return engine_blocks(max_len) * 16 * per_token * element


class EngineWorker:
    """The bundled engine, driven synchronously (whichever engine_backend is importable)."""

    def __init__(self, model: str, dtype: str, max_len: int) -> None:
        from engine_backend.config import EngineConfig
        from engine_backend.llm_engine import LLMEngine
        from engine_backend.sampling import SamplingParams

        self.params = SamplingParams
        self.llm = LLMEngine(
            EngineConfig(
                model=model,
                device="cpu",
                dtype=dtype,
                num_blocks=engine_blocks(max_len),
                max_num_batched_tokens=max(2048, max_len),
            )
        )
        self.count = 0
        self.first_token_at: float | None = None

    def run(self, prompts: list[list[int]], max_tokens: int, cold: bool) -> list[list[int]]:
        if cold:
            self.llm.reset_prefix_cache()
        ids = []
        for prompt in prompts:
            self.count += 1
            ids.append(f"r{self.count}")
            params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self.llm.add_request(ids[-1], prompt, params)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        self.first_token_at = None
        for _ in range(100_000):
            if not self.llm.has_unfinished():
                break
            for out in self.llm.step():
                tokens[out.request_id].extend(out.new_token_ids)
            if self.first_token_at is None and all(tokens.values()):
                self.first_token_at = time.perf_counter()
        return [tokens[i] for i in ids]


class VllmWorker:
    def __init__(self, model: str, dtype: str, max_len: int) -> None:
        from vllm import LLM, SamplingParams

        self.params = SamplingParams
        self.first_token_at: float | None = None  # not observable here: the parent subtracts
        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_len,
            enable_prefix_caching=True,
            max_num_batched_tokens=max(2048, max_len),
            kv_cache_memory_bytes=engine_kv_bytes(model, dtype, max_len),
        )

    def run(self, prompts: list[list[int]], max_tokens: int, cold: bool) -> list[list[int]]:
        if cold:
            self.llm.reset_prefix_cache()
        params = self.params(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


class TransformersWorker:
    """transformers' generate: no cache across requests, so `cold` changes nothing."""

    def __init__(self, model: str, dtype: str, max_len: int) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype)
        ).eval()
        self.first_token_at: float | None = None

    def run(self, prompts: list[list[int]], max_tokens: int, cold: bool) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        # Left padding; the bench's batched prompts all have one length, so none is padded.
        x = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        worker = self

        class FirstToken:
            """generate's streamer: put() gets the prompt, then each step's new tokens."""

            calls = 0

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls == 2:
                    worker.first_token_at = time.perf_counter()

            def end(self) -> None:
                pass

        self.first_token_at = None
        with torch.inference_mode():
            out = self.model.generate(
                x,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=FirstToken(),
            )
        return [row[width:].tolist() for row in out]


WORKERS = {"engine": EngineWorker, "vllm": VllmWorker, "transformers": TransformersWorker}


def worker_main(kind: str, model: str, dtype: str, threads: int, max_len: int) -> int:
    """Serve JSON lines on stdin: {"prompts", "max_tokens", "cold"} -> {"seconds", "tokens"}."""
    import torch

    torch.set_num_threads(threads)
    worker = WORKERS[kind](model, dtype, max_len)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        tokens = worker.run(request["prompts"], request["max_tokens"], request["cold"])
        ended = time.perf_counter()
        first = worker.first_token_at
        answer = {"seconds": ended - started, "tokens": tokens}
        # Seconds from every request's first token to the end, where the worker can see it.
        answer["after_first_s"] = None if first is None else ended - first
        print(json.dumps(answer), flush=True)
    return 0


# -- the parent ----------------------------------------------------------------------------


class Contender:
    """One worker process; `ask` sends a request and waits for its answer (bounded)."""

    def __init__(self, name: str, python: str, kind: str, pythonpath: str, args: Any) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(args.threads)}
        if kind == "vllm":
            env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind")
            env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        command = [python, os.path.abspath(__file__), "--worker", kind, "--model", args.model]
        command += ["--dtype", args.dtype_now, "--threads", str(args.threads)]
        command += ["--max-len", str(args.max_len)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        # A reader thread, so that every wait for the worker has a deadline.
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._read(WORKER_START_TIMEOUT_S)  # {"ready": true} once loaded

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout_s: float = WORKER_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise RuntimeError(
                    f"{self.name} worker gave no answer in {timeout_s:.0f} s"
                ) from None
            if line is None:
                raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, prompts: list[list[int]], max_tokens: int, cold: bool) -> dict:
        assert self.proc.stdin is not None
        request = {"prompts": prompts, "max_tokens": max_tokens, "cold": cold}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M shape)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1510, help="cold prompt length")
    p.add_argument("--uncached", type=int, default=25, help="new tokens of the warm prompt")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--base", default=None, help="a git commit: also run its engine_backend")
    p.add_argument("--vllm-python", default=None, help="an interpreter that imports vllm")
    p.add_argument("--quick", action="store_true", help="short prompts, one repeat")
    p.add_argument("--cache-dir", default=None, help="where the random checkpoint is written")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "engine_vs_vllm.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = min(args.tokens, 256), 1
        args.decode_tokens, args.greedy_tokens = min(args.decode_tokens, 8), 16
    return args


def vllm_interpreter(args: argparse.Namespace) -> str | None:
    if args.vllm_python:
        found = subprocess.run(
            [args.vllm_python, "-c", "import vllm"], capture_output=True, timeout=300
        )
        return args.vllm_python if found.returncode == 0 else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def base_tree(commit: str, into: str) -> str:
    """engine_backend as of `commit`, extracted under `into` (for PYTHONPATH)."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", commit, "engine_backend"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True, timeout=60)
    return into


def measure(contenders: list[Contender], args: argparse.Namespace, vocab: int) -> dict:
    """Every measurement, contenders alternating order on each request."""
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {c.name: {} for c in contenders}

    def each(key: str, prompts: list[list[int]], max_tokens: int, cold: bool, turn: int) -> None:
        order = contenders if turn % 2 == 0 else contenders[::-1]
        for contender in order:
            answer = contender.ask(prompts, max_tokens, cold)
            results[contender.name].setdefault(key, []).append(answer["seconds"])
            if answer["after_first_s"] is not None:
                results[contender.name].setdefault(key + "_after_first", [])
                results[contender.name][key + "_after_first"].append(answer["after_first_s"])

    # One untimed pass of each shape first: one-time costs (allocator growth, kernel
    # selection, a lazily built graph) are not what cold TTFT measures.
    for contender in contenders:
        contender.ask([[rng.randrange(vocab) for _ in range(args.tokens)]], 2, True)
        contender.ask([[rng.randrange(vocab) for _ in range(64)] for _ in range(8)], 2, True)
    for turn in range(args.repeats):
        base = [rng.randrange(vocab) for _ in range(args.tokens)]
        each("cold_ttft_s", [base], 1, True, turn)
        warm = base[: args.tokens - args.uncached]
        warm += [rng.randrange(vocab) for _ in range(args.uncached)]
        each("warm_ttft_s", [warm], 1, False, turn + 1)
        for batch in (1, 8):
            prompts = [[rng.randrange(vocab) for _ in range(64)] for _ in range(batch)]
            each(f"b{batch}_first_s", prompts, 1, True, turn)
            each(f"b{batch}_all_s", prompts, args.decode_tokens + 1, True, turn + 1)
    summary: dict[str, Any] = {}
    for name, times in results.items():
        best = {key: min(values) for key, values in times.items()}
        row = {"cold_ttft_s": best["cold_ttft_s"], "warm_ttft_s": best["warm_ttft_s"]}
        for batch in (1, 8):
            # From the first token on where the worker saw it; else the difference of a run
            # of decode_tokens + 1 and a run of 1 (vLLM's offline API shows only the end).
            decode_s = best.get(f"b{batch}_all_s_after_first")
            if decode_s is None:
                decode_s = best[f"b{batch}_all_s"] - best[f"b{batch}_first_s"]
            row[f"decode_b{batch}_tok_s"] = batch * args.decode_tokens / max(decode_s, 1e-9)
        row["samples_s"] = times  # every timing, in the order taken
        summary[name] = row
    return summary


def greedy(contenders: list[Contender], args: argparse.Namespace) -> dict[str, list[list[int]]]:
    from bench.smollm2_checkpoint import GREEDY_TEXTS
    from engine_backend.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.model)
    prompts = [tokenizer.encode(text) for text in GREEDY_TEXTS]
    return {c.name: c.ask(prompts, args.greedy_tokens, True)["tokens"] for c in contenders}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_dtype(args: argparse.Namespace, dtype: str, base_path: str | None) -> dict:
    from engine_backend.checkpoint import load_hf_config

    args.dtype_now = dtype
    vllm_python = vllm_interpreter(args)
    here = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    names = [("engine", sys.executable, "engine", here)]
    if base_path is not None:
        names.append((f"engine@{args.base}", sys.executable, "engine", base_path))
    if vllm_python is not None:
        reference = "vllm"
        names.append(("vllm", vllm_python, "vllm", ""))
    else:
        print("vLLM is not installed: comparing with transformers instead", file=sys.stderr)
        reference = "transformers"
        names.append(("transformers", sys.executable, "transformers", here))
    contenders = [Contender(name, python, kind, path, args) for name, python, kind, path in names]
    try:
        vocab = int(load_hf_config(args.model)["vocab_size"])
        summary = measure(contenders, args, vocab)
        outputs = greedy(contenders, args)
    finally:
        for contender in contenders:
            contender.close()
    for name, row in summary.items():
        pairs = list(zip(outputs[name], outputs[reference], strict=True))
        same = sum(a == b for a, b in pairs)
        row["greedy_identical"] = f"{same}/{len(pairs)}"
        # Per prompt, the first generated position where the two differ (None: identical).
        row["greedy_first_difference"] = [first_difference(a, b) for a, b in pairs]
    return {"dtype": dtype, "reference": reference, "contenders": summary}


def print_table(result: dict) -> None:
    rows = result["contenders"]
    reference = rows[result["reference"]]
    print(f"\n{result['dtype']}: ratios are contender / {result['reference']} (lower is faster)")
    print(
        f"{'':>22} {'cold TTFT s':>12} {'ratio':>6} {'warm TTFT s':>12} {'ratio':>6} "
        f"{'dec b1 tok/s':>12} {'dec b8 tok/s':>12} {'greedy =':>9}"
    )
    for name, row in rows.items():
        print(
            f"{name:>22} {row['cold_ttft_s']:>12.3f} "
            f"{row['cold_ttft_s'] / reference['cold_ttft_s']:>6.2f} "
            f"{row['warm_ttft_s']:>12.3f} {row['warm_ttft_s'] / reference['warm_ttft_s']:>6.2f} "
            f"{row['decode_b1_tok_s']:>12.1f} {row['decode_b8_tok_s']:>12.1f} "
            f"{row['greedy_identical']:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.model, args.dtype[0], args.threads, args.max_len)
    if args.model is None:
        sys.path.insert(0, ROOT)
        from bench.smollm2_checkpoint import build_checkpoint

        args.model = build_checkpoint(args.cache_dir)
        print(f"model: SmolLM2-135M-shaped random checkpoint ({args.model})", file=sys.stderr)
    args.max_len = max(4096, args.tokens + args.greedy_tokens + 64)
    scratch = tempfile.mkdtemp(prefix="engine-vs-vllm-")
    try:
        base_path = base_tree(args.base, scratch) if args.base else None
        results = [run_dtype(args, dtype, base_path) for dtype in args.dtype]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.tokens}-token cold prompt, warm prompt {args.uncached} tokens uncached, ")
    print(f"{args.threads} threads, best of {args.repeats}; measured on this machine as it is")
    for result in results:
        print_table(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
