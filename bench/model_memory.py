"""Whole-model peak memory of one training micro-step: chunked log-probs vs full logits.

What it measures. One GSPO micro-step on a random-weight Qwen2 causal LM with the shape of
Qwen2.5-0.5B (hidden 896, MLP 4864, 24 layers, 14 query / 2 key-value heads, vocab 151,936,
tied embeddings), built from a `Qwen2Config` (nothing is downloaded), written once with
``save_pretrained`` and loaded in each worker the way `gspo train` loads a user's checkpoint
(`gspo.train.run.build_policy`: from_pretrained, `model.gradient_checkpointing`, the trainer's
mode), with gradient checkpointing on unless --no-grad-ckpt. The step is

    logp = <path>(model, input_ids, attention_mask, completion_len)      # (N, T) fp32
    loss = gspo.algo.policy_loss(logp, old_logp, adv, mask, level="sequence")[0]
    loss.backward()

for two paths:

    chunked  gspo.models.logprobs.token_logprobs: the decoder body once, then the LM head and the
             log-softmax a chunk of tokens at a time under activation checkpointing
    naive    gspo.models.logprobs.naive_token_logprobs: model(...).logits, the whole (N, L, V) at once

Each path runs in its own fresh subprocess, so that the peaks do not mix. The figure is the
peak memory of the step above the baseline, the memory held once the model and the inputs
are built, just before the step:

    CUDA  torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() at the baseline
    CPU   peak resident set (VmHWM, reset by writing "5" to /proc/self/clear_refs) minus the
          resident set (VmRSS) at the baseline; where clear_refs cannot reset VmHWM, VmRSS is
          sampled every 5 ms by a thread and the largest sample is taken (a lower bound).
          The workers run with MALLOC_MMAP_THRESHOLD_=131072, so that glibc serves every
          block over 128 KiB with mmap and freed tensors leave the resident set at once
          (otherwise the step could reuse heap pages freed while building the model, and
          its growth would be under-counted).

The peak includes everything the step allocates: activations (one hidden state per layer
with checkpointing, plus one layer's recomputation), the logits, the parameter gradients
(which stay after the step) and the autograd graph. The measured step is the FIRST step of
the process, with no warm-up: one-time costs (thread pools, kernel workspaces, and for the
chunked path its one-off check that the LM head reproduces ``model(...).logits`` on 16
tokens) are inside the figure. Wall time is that step's forward + loss + backward, one sample,
taken under the same MALLOC_MMAP_THRESHOLD_ (every large allocation faults in fresh pages, so
on CPU it is somewhat pessimistic, and noisy on a shared machine).

Agreement. Each worker saves its loss, its (N, T) log-probs and the gradients of a few
parameters (the tied embedding / LM head, the first layer's q_proj, the last layer's
mlp.down_proj, the final norm) to a safetensors file; the parent compares them as
max|a - b| / max|b| (tolerance 1e-5 in fp32, 2e-2 in bf16 unless --rtol is given). The
log-probs are compared as well as the loss because with old_logp = logp.detach() + noise
the loss value depends on the noise and the advantages, hardly on logp itself.

    python bench/model_memory.py                         # Qwen2.5-0.5B shape, 8 x 512 tokens
    python bench/model_memory.py --batch 4 --json out.json
    python bench/model_memory.py --dtype bfloat16 --device cuda
    python bench/model_memory.py --layers 2 --hidden 64 --vocab 1000 --batch 2 \\
        --prompt-len 16 --completion-len 16                 # tiny, ~10 s (imports)

The exit status is 1 when the two paths disagree.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("chunked", "naive")
# Parameters whose gradients are compared between the two paths (names in Qwen2ForCausalLM;
# "{last}" is the index of the last decoder layer).
GRAD_PARAMS = (
    "model.embed_tokens.weight",  # tied with lm_head.weight: input and head gradients
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.{last}.mlp.down_proj.weight",
    "model.norm.weight",
)
DEFAULT_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}
MIB = 2**20


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=24, help="decoder layers")
    p.add_argument("--hidden", type=int, default=896, help="hidden size")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP size (default hidden * 38 / 7, i.e. 4864 at hidden 896)")
    p.add_argument("--heads", type=int, default=None,
                   help="query heads (default hidden // 64, at least 1)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key-value heads (default 2 when heads is even, else 1)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    p.add_argument("--batch", type=int, default=8, help="sequences N")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--completion-len", type=int, default=448,
                   help="completion tokens per sequence (all real, mask of ones)")
    p.add_argument("--chunk-size", type=int, default=1024, help="chunked path's chunk size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads in the workers (0: torch's default)")
    p.add_argument("--no-grad-ckpt", action="store_true",
                   help="disable gradient checkpointing of the decoder layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=None,
                   help="agreement tolerance, max|a-b|/max|b| (default 1e-5 fp32, 2e-2 bf16)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--worker", choices=PATHS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def _shape(args: argparse.Namespace) -> dict[str, int]:
    """The model shape, with the defaults that depend on --hidden filled in."""
    heads = args.heads or max(1, args.hidden // 64)
    kv_heads = args.kv_heads or (2 if heads % 2 == 0 else 1)
    intermediate = args.intermediate or round(args.hidden * 38 / 7)
    return {"layers": args.layers, "hidden": args.hidden, "intermediate": intermediate,
            "heads": heads, "kv_heads": kv_heads, "vocab": args.vocab}


def _worker_argv(args: argparse.Namespace, path: str, out: Path) -> list[str]:
    """The command line that runs `path` in a fresh interpreter with the same settings."""
    shape = _shape(args)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", path, "--out", str(out),
            "--model-dir", str(args.model_dir),
            "--layers", str(shape["layers"]), "--hidden", str(shape["hidden"]),
            "--intermediate", str(shape["intermediate"]), "--heads", str(shape["heads"]),
            "--kv-heads", str(shape["kv_heads"]), "--vocab", str(shape["vocab"]),
            "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
            "--completion-len", str(args.completion_len), "--chunk-size", str(args.chunk_size),
            "--dtype", args.dtype, "--device", args.device, "--threads", str(args.threads),
            "--seed", str(args.seed)]
    if args.no_grad_ckpt:
        argv.append("--no-grad-ckpt")
    return argv


# ----------------------------------------------------------------------------- CPU memory


def _status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current VmRSS through /proc/self/clear_refs; True if it worked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") - _status_kib("VmRSS") < 4096  # within 4 MiB of VmRSS


def _touch_and_unmap(nbytes: int, hold_s: float = 0.0) -> None:
    """Map `nbytes` of fresh anonymous memory, write every page, hold it `hold_s`, unmap it.

    mmap directly, not through an allocator: glibc, jemalloc and tcmalloc may each serve an
    allocation from pages a freed block left resident, which the RSS never sees grow."""
    block = mmap.mmap(-1, nbytes)
    page = mmap.PAGESIZE
    for offset in range(0, nbytes, page):
        block[offset] = 1
    time.sleep(hold_s)
    block.close()


def _hwm_reset_works() -> bool:
    """Whether writing to clear_refs really lowers VmHWM: touch and free 64 MiB, then reset."""
    _touch_and_unmap(64 * MIB)
    return _reset_hwm() and _status_kib("VmHWM") < _status_kib("VmRSS") + 32 * 1024


class RssSampler:
    """Largest VmRSS seen by a thread polling /proc/self/status every `interval` seconds."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak_kib = _status_kib("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))


# ----------------------------------------------------------------------------- worker


def save_random_model(args: argparse.Namespace, directory: Path) -> Path:
    """A random-weight Qwen2ForCausalLM of the requested shape (fp32), written with
    ``save_pretrained`` with a tokenizer beside it, as a user's checkpoint comes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT / "src"))
    from gspo.models.tiny import build_char_tokenizer

    shape = _shape(args)
    config = Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    build_char_tokenizer().save_pretrained(directory)  # (the inputs are random ids: any tokenizer loads)
    return directory


def _load_model(args: argparse.Namespace, device: Any) -> Any:
    """The saved model loaded as `gspo train` loads it (`gspo.train.run.build_policy`: from_pretrained,
    model.gradient_checkpointing, the trainer's mode), not built in this process."""
    import torch

    from gspo.config import load_config
    from gspo.train.run import build_policy

    cfg = load_config(None, [f"model.name_or_path={args.model_dir}", f"model.dtype={args.dtype}",
                             f"model.gradient_checkpointing={str(not args.no_grad_ckpt).lower()}"])
    model, _ = build_policy(cfg, device)
    with torch.no_grad():  # weights from disk may be memory-mapped: page them in before the baseline
        for p in model.parameters():
            p.sum()
    return model


def _inputs(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Token ids (all real), mask, the old-log-prob noise and the advantages, seeded."""
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    n, t = args.batch, args.completion_len
    ids = torch.randint(0, args.vocab, (n, args.prompt_len + t), generator=g)  # (N, P+T)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),  # (N, P+T)
        # per-token log-ratio noise: the sequence means (~1e-4 / sqrt(T)) stay inside GSPO's
        # clip range (1 - 3e-4, 1 + 4e-4), so every sequence carries a gradient
        "noise": (1e-4 * torch.randn(n, t, generator=g)).to(device),  # (N, T)
        "adv": torch.randn(n, generator=g).to(device),  # (N,)
        "mask": torch.ones(n, t, dtype=torch.bool).to(device),  # (N, T)
    }


def _grad_names(model: Any) -> list[str]:
    last = model.config.num_hidden_layers - 1
    return [name.format(last=last) for name in GRAD_PARAMS]


def _step(model: Any, path: str, inputs: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any]:
    """Log-probs by `path`, GSPO loss and backward; returns (loss, logp), both detached."""
    from gspo.algo import policy_loss
    from gspo.config import PAPER_CLIP
    from gspo.models.logprobs import naive_token_logprobs, token_logprobs

    fn = token_logprobs if path == "chunked" else naive_token_logprobs
    logp = fn(model, inputs["input_ids"], inputs["attention_mask"], args.completion_len,
              temperature=1.0, chunk_size=args.chunk_size)  # (N, T) fp32
    old_logp = logp.detach() + inputs["noise"]  # (N, T)
    loss, _ = policy_loss(logp, old_logp, inputs["adv"], inputs["mask"], level="sequence",
                          eps_low=PAPER_CLIP["sequence"][0], eps_high=PAPER_CLIP["sequence"][1], max_log_ratio=10.0)
    loss.backward()
    return loss.detach(), logp.detach()


def _measure(fn: Callable[[], Any], device: Any) -> tuple[Any, dict[str, Any]]:
    """Run fn once; return its result and the memory figures (MiB) and wall time (s)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return out, {
            "baseline_mib": base / MIB,
            "peak_above_baseline_mib": (torch.cuda.max_memory_allocated() - base) / MIB,
            "after_above_baseline_mib": (torch.cuda.memory_allocated() - base) / MIB,
            "wall_s": wall,
            "method": "torch.cuda.max_memory_allocated - memory_allocated at baseline",
        }
    use_hwm = _hwm_reset_works()
    base_kib = _status_kib("VmRSS")
    if use_hwm:
        _reset_hwm()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        peak_kib, method = _status_kib("VmHWM"), "VmHWM (reset via clear_refs) - VmRSS"
    else:
        sampler = RssSampler()
        sampler.start()
        t0 = time.perf_counter()
        try:
            out = fn()
        finally:
            wall = time.perf_counter() - t0
            sampler.stop()
        peak_kib, method = sampler.peak_kib, "max VmRSS sampled every 5 ms - VmRSS (lower bound)"
    return out, {
        "baseline_mib": base_kib / 1024,
        "peak_above_baseline_mib": (peak_kib - base_kib) / 1024,
        "after_above_baseline_mib": (_status_kib("VmRSS") - base_kib) / 1024,
        "wall_s": wall,
        "method": method,
    }


def worker(args: argparse.Namespace) -> None:
    """Build the model and inputs, measure one step of `args.worker`, save tensors, print JSON."""
    sys.path.insert(0, str(ROOT / "src"))  # benchmark this checkout's gspo
    import torch
    from safetensors.torch import save_file

    from gspo.models import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model = _load_model(args, device)
    inputs = _inputs(args, device)
    (loss, logp), mem = _measure(lambda: _step(model, args.worker, inputs, args), device)

    params = dict(model.named_parameters())
    tensors = {"loss": loss.float().reshape(1).cpu(), "logp": logp.float().cpu()}
    for name in _grad_names(model):
        tensors["grad." + name] = params[name].grad.float().cpu().contiguous()
    save_file(tensors, str(args.out))
    unique = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
    param_bytes = sum(p.numel() * p.element_size() for p in unique)
    print(json.dumps({
        "path": args.worker,
        **mem,
        "param_mib": param_bytes / MIB,
        "n_params": sum(p.numel() for p in unique),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "attn_implementation": model.config._attn_implementation,
        "torch": torch.__version__,
    }))


# ----------------------------------------------------------------------------- parent


def _run_worker(args: argparse.Namespace, path: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed blocks over 128 KiB leave the RSS at once
    t0 = time.perf_counter()
    proc = subprocess.run(_worker_argv(args, path, out), env=env, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} worker failed (exit {proc.returncode}):\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def _rel_diff(a: Any, b: Any) -> float:
    """max|a - b| / max|b| (max|a - b| itself when b is all zeros)."""
    scale = b.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def _compare(chunked: Path, naive: Path) -> dict[str, float]:
    """Relative differences of every saved tensor, chunked against naive."""
    from safetensors.torch import load_file

    a, b = load_file(str(chunked)), load_file(str(naive))
    return {key: _rel_diff(a[key], b[key]) for key in b}


def _markdown(result: dict[str, Any]) -> str:
    cfg, runs = result["config"], result["paths"]
    lines = [
        (f"Qwen2 {cfg['layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']} "
         f"({runs['naive']['n_params'] / 1e6:.1f}M params, {runs['naive']['param_mib']:.0f} MiB), "
         f"{cfg['batch']} x {cfg['prompt_len'] + cfg['completion_len']} tokens "
         f"({cfg['prompt_len']} prompt + {cfg['completion_len']} completion), {cfg['dtype']}, "
         f"{runs['naive']['device']}, grad ckpt {'off' if cfg['no_grad_ckpt'] else 'on'}, "
         f"{runs['naive']['threads']} threads, attention {runs['naive']['attn_implementation']}"),
        "",
        "| path | baseline MiB | peak above baseline MiB | left after step MiB | step wall s |",
        "|---|---:|---:|---:|---:|",
    ]
    for path in PATHS:
        r = runs[path]
        lines.append(f"| {path} | {r['baseline_mib']:.0f} | {r['peak_above_baseline_mib']:.0f} | "
                     f"{r['after_above_baseline_mib']:.0f} | {r['wall_s']:.1f} |")
    lines += [
        "",
        (f"chunked / naive peak: {result['ratio']:.3f}. Memory: {runs['naive']['method']}; "
         "first step of a fresh process, no warm-up. Full fp32 logits of the batch would be "
         f"{result['full_logits_mib']:.1f} MiB."),
        "",
        f"| agreement, max abs diff / max abs (tolerance {result['rtol']:g}) | value |",
        "|---|---:|",
    ]
    lines += [f"| {key} | {value:.2e} |" for key, value in result["agreement"].items()]
    lines.append(f"\nagree: {result['agree']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both paths in fresh subprocesses, compare them, print a table; return the results."""
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[args.dtype]
    with tempfile.TemporaryDirectory(prefix="gspo-model-memory-") as tmp:
        args.model_dir = save_random_model(args, Path(tmp) / "model")
        files = {path: Path(tmp) / f"{path}.safetensors" for path in PATHS}
        runs = {path: _run_worker(args, path, files[path]) for path in PATHS}
        agreement = _compare(files["chunked"], files["naive"])
    tokens = args.batch * (args.prompt_len + args.completion_len)
    result = {
        "command": "python bench/model_memory.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]),
        "config": {**_shape(args), "batch": args.batch, "prompt_len": args.prompt_len,
                   "completion_len": args.completion_len, "chunk_size": args.chunk_size,
                   "dtype": args.dtype, "no_grad_ckpt": args.no_grad_ckpt, "seed": args.seed},
        "paths": runs,
        "ratio": runs["chunked"]["peak_above_baseline_mib"]
        / runs["naive"]["peak_above_baseline_mib"],
        "full_logits_mib": tokens * args.vocab * 4 / MIB,
        "agreement": agreement,
        "rtol": rtol,
        "agree": all(value <= rtol for value in agreement.values()),
    }
    print(_markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main().get("agree", True) else 1)
