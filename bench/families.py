"""gspo train on a tiny random checkpoint of each transformers causal-LM family, saved with
``save_pretrained`` and loaded by path as a user's own is: does the run go through, and are the
sampler's log-probs the trainer's?

    python bench/families.py                              # every family in FAMILIES, each mode
    python bench/families.py --families qwen2 olmoe --modes default replay
    python bench/families.py --json families.json

For each family: a config of the family's own class (hidden 32, 2 layers, 4 heads over 2 KV
heads, 4 experts top-2 where it has experts; a hybrid gets one recurrent layer and one
attention layer), a Qwen-style byte-level tokenizer (tests/artifacts.py), the weights seeded,
then `gspo train model.name_or_path=DIR` through `gspo.cli.main` for 2 rollouts of 2 prompts x
4 completions of up to 8 tokens on the arithmetic task, in its own process. Modes:

- ``default``: as a user starts it (the sampler's log-probs are pi_old);
- ``share``: ``model.share_prompt_min_work=0 rollout.old_logp=trainer``: every trainer call
  runs each prompt once where the model's cache allows it, and pi_old is a trainer pass;
- ``gc``: ``model.gradient_checkpointing=true rollout.old_logp=trainer`` (dense families);
- ``replay``: ``algo.routing_replay=true`` (families with experts);
- ``gc-replay``: ``gc`` and ``replay`` together (families with experts): each checkpointed
  layer runs its router again in the backward pass, where replay must act as in the forward;
- ``lora``: ``lora.enabled=true`` (peft's all-linear adapters; final/ holds the merged model);
- ``async``: ``rollout.mode=async rollout.max_staleness=0``: a generator process samples with
  the weights the learner sends it, on-policy, so its log-probs must be the learner's;
- ``tied``: as ``default``, on a checkpoint whose LM head is its input embedding
  (``tie_word_embeddings=True``, as Qwen3-0.6B, Llama-3.2-1B and Gemma ship);
- ``fsdp``: ``torchrun --nproc-per-node 2`` (FSDP2 on gloo) against one process on the same
  global batch, at ``optim.lr=0.1`` with AdamW's eps 1 (SGD with momentum for these
  gradients, so that the rounding of a near-zero gradient does not become a step of lr) so
  that training moves the weights well past float rounding; final/ of the two runs must agree
  within 1e-5 (``tests/test_distributed.py``'s bound for the built-in model).

A cell passes when the run exits 0, its losses are finite, the largest sampler / trainer gap of
a token's log-prob (``mismatch/token_abs_max``) is below 1e-4, the first minibatch's sequence
ratios are 1 within 1e-5, and final/ is the trained model as a user loads it:
``AutoModelForCausalLM`` and ``AutoTokenizer`` read it with no missing, unexpected or
mismatched weights, its weights are the run's last checkpoint's (with LoRA: the base with
final/adapter merged in, compared by logits), and they differ from the checkpoint it started
from. A refusal at start-up (one message naming the field, exit code 2) is reported as such,
with its message.

The families are those of transformers' causal-LM mapping that users train (dense, MoE,
hybrid); the installed transformers must know each one (5.24 does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DENSE = ["qwen2", "qwen3", "llama", "mistral", "ministral", "gemma", "gemma2", "gemma3_text", "gemma4_text",
         "vaultgemma", "phi", "phi3", "olmo2", "olmo3", "granite", "cohere", "cohere2", "stablelm", "starcoder2",
         "gpt2", "gpt_neox", "gpt_bigcode", "gptj", "bloom", "opt", "falcon", "glm4", "smollm3", "ernie4_5",
         "exaone4", "hunyuan_v1_dense", "seed_oss", "helium", "apertus", "arcee", "internlm3", "nemotron"]
HYBRID = ["qwen3_5_text", "qwen3_next", "lfm2", "falcon_h1", "bamba", "jamba", "granitemoehybrid"]
MOE = ["qwen2_moe", "qwen3_moe", "mixtral", "phimoe", "olmoe", "granitemoe", "deepseek_v2", "deepseek_v3",
       "glm4_moe", "gpt_oss", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "minimax", "jetmoe", "dbrx", "llama4_text"]
FAMILIES = DENSE + HYBRID + MOE
MODES = {"default": [], "share": ["model.share_prompt_min_work=0", "rollout.old_logp=trainer"],
         "gc": ["model.gradient_checkpointing=true", "rollout.old_logp=trainer"],
         "replay": ["algo.routing_replay=true"], "lora": ["lora.enabled=true"],
         # (the routers run again in each checkpointed layer's recomputation, replayed as in the forward)
         "gc-replay": ["model.gradient_checkpointing=true", "rollout.old_logp=trainer", "algo.routing_replay=true"],
         "async": ["rollout.mode=async", "rollout.max_staleness=0"], "tied": [],
         # (sampling chunks of 4 rows: the same samples on 1 or 2 ranks; AdamW with eps 1 is SGD with momentum for
         # these gradients, so that float rounding in a near-zero gradient is not blown up to a step of lr)
         "fsdp": ["optim.lr=0.1", "optim.adam_eps=1.0", "rollout.batch_size=4"]}
FSDP_TOL = 1e-5

# the shared small shape, under every name the families use for it
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256, n_positions=256, sliding_window=16, tie_word_embeddings=False,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_topk=2, top_k=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
             first_k_dense_replace=0, n_group=1, topk_group=1, decoder_sparse_step=1, mlp_only_layers=[],
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
# where a family's own checks need other values (each family's config validates its shapes)
SHAPE_FOR = {
    "gptj": dict(rotary_dim=8),
    "deepseek_v2": dict(num_key_value_heads=4), "deepseek_v3": dict(num_key_value_heads=4),  # MLA: one KV head a query head
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_ssm=64),
    "jamba": dict(mamba_d_state=16, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16),
}

# settings a family needs on top of each mode's (MiniMax-Text keeps a cache class of its own, which
# gspo's decode loop does not drive: gspo train says so and names this setting)
FAMILY_ARGS = {"minimax": ["rollout.decode=generate"]}


def family_config(family: str, vocab: int, special: dict):
    """The family's own config class at the shared small shape. Names a class does not take are
    ignored by it; a name it exposes as a read-only property is dropped and the build retried."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kw = {**SHAPE, **SHAPE_FOR.get(family, {}), "vocab_size": vocab, **special}
    for _ in range(len(kw)):
        try:
            config = CONFIG_MAPPING[family](**kw)
            break
        except AttributeError as e:
            name = re.search(r"property '(\w+)'", str(e))
            if name is None or name.group(1) not in kw:
                raise
            kw.pop(name.group(1))
    types = getattr(config, "layer_types", None)
    if types and len(set(types)) == 1 and types[0] not in ("full_attention", "sliding_attention"):
        try:  # a hybrid: a recurrent layer, then attention
            config.layer_types = [types[0], "full_attention"]
        except AttributeError:  # (derived from other fields: the family's own pattern stays)
            pass
    return config


def save_family(directory: Path, family: str, tied: bool = False) -> int:
    """Write the tiny `family` checkpoint and its tokenizer to `directory`; returns its size.
    `tied`: the LM head is the input embedding."""
    import torch
    import transformers as T

    sys.path.insert(0, str(ROOT / "tests"))
    import artifacts

    tok = artifacts.build_tokenizer("qwen")
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = family_config(family, len(tok), special)
    if tied:
        config.tie_word_embeddings = True
        getattr(config, "get_text_config", lambda **_: config)(decoder=True).tie_word_embeddings = True
    torch.manual_seed(0)
    try:
        model = T.AutoModelForCausalLM.from_config(config).float()
    except Exception:
        if getattr(config, "layer_types", None) is None:
            raise
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers  # the family's own default
        model = T.AutoModelForCausalLM.from_config(config).float()
    model.generation_config = T.GenerationConfig(**special)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run_cell(family: str, mode: str, work: Path) -> dict:
    """In this process: save the checkpoint, train on it, read the run's metrics."""
    import io
    from contextlib import redirect_stderr

    from gspo.cli import main

    out = {"family": family, "mode": mode}
    ckpt = work / (f"ckpt-{family}-tied" if mode == "tied" else f"ckpt-{family}")
    try:
        if not ckpt.exists():
            out["params"] = save_family(ckpt, family, tied=mode == "tied")
        if mode == "tied" and not tied(__import__("transformers").AutoModelForCausalLM.from_pretrained(ckpt)):
            out["skipped"] = "the family's checkpoint does not keep a tied head"
            return out
        err = io.StringIO()
        args = ["train", f"model.name_or_path={ckpt}", "rollout.prompts_per_step=2", "rollout.group_size=4",
                "rollout.max_new_tokens=8", "schedule.rollouts=2", "schedule.num_minibatches=2",
                "logging.console=false", "data.source=arithmetic", f"output.dir={work / 'runs'}",
                f"output.name={family}-{mode}",
                "rewards.functions=[{name: exact_answer}, {name: 'artifacts:signal_reward'}]", *MODES[mode],
                *FAMILY_ARGS.get(family, [])]
        with redirect_stderr(err):
            out["rc"] = main(args)
        if mode == "fsdp" and out["rc"] == 0:  # that was the one-process reference: now torchrun
            args[args.index(f"output.name={family}-{mode}")] = f"output.name={family}-{mode}-2"
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", "-m", "gspo", *args], capture_output=True, text=True, timeout=600,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
            out["rc"] = 2 if "ConfigError" in proc.stderr or "config field" in proc.stderr else proc.returncode
            err = io.StringIO(proc.stderr)
        if out["rc"] != 0:
            lines = [x for x in err.getvalue().splitlines() if "error" in x.lower()]
            out["message"] = (lines or err.getvalue().splitlines() or [""])[-1][:300]
            return out
        run_dir = work / "runs" / (f"{family}-{mode}-2" if mode == "fsdp" else f"{family}-{mode}")
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if r.get("loss") is not None]
        out["steps"] = len(steps)
        out["mismatch_max"] = max((r.get("mismatch/token_abs_max") or 0.0) for r in steps) if steps else None
        first = steps[0] if steps else {}
        out["first_ratio"] = [first.get("ratio/seq_min"), first.get("ratio/seq_max")]
        out["finite"] = all(math.isfinite(r["loss"]) for r in steps)
        out["final"] = (compare_finals(run_dir, work / "runs" / f"{family}-{mode}", ckpt) if mode == "fsdp"
                        else check_final(run_dir, ckpt, lora=mode == "lora"))
    except Exception as e:  # noqa: BLE001  (a cell's failure is its result)
        if mode == "tied" and "tie_word_embeddings" in str(e) and "params" not in out:
            out["skipped"] = "the family's config refuses tie_word_embeddings"
        else:
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def tied(model) -> bool:
    """Whether the model's LM head is its input embedding (one tensor)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def check_final(run_dir: Path, base: Path, lora: bool) -> str:
    """"ok", or what is wrong with run_dir/final as a user loads it (see the module docstring)."""
    import torch
    import transformers as T
    from safetensors.torch import load_file

    final = run_dir / "final"
    T.AutoTokenizer.from_pretrained(final)
    model, info = T.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | ({"errors": info["error_msgs"]}
                                                                          if info.get("error_msgs") else {})
    if bad:
        return f"loading final/: {bad}"
    model.eval()
    probe = torch.arange(3, 19).reshape(2, 8)

    def logits(m):
        with torch.no_grad():
            return m(input_ids=probe).logits.float()

    start = T.AutoModelForCausalLM.from_pretrained(base).eval()
    if tied(start) and not tied(model):
        return "final/ has a head of its own where the checkpoint's head is its input embedding"
    if lora:  # the base with final/adapter on top, as peft loads it, and merged
        from peft import PeftModel
        ref = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(base), final / "adapter").eval()
        gap = (logits(ref) - logits(model)).abs().max().item()
        if gap > 1e-4:
            return f"final/ is not the base with final/adapter merged in (logits differ by {gap:.2e})"
    else:  # every weight of final/ is the last checkpoint's
        last = (run_dir / "checkpoints" / "latest").read_text().strip()
        saved = load_file(run_dir / "checkpoints" / last / "model.safetensors")
        own = model.state_dict()
        for name, value in own.items():
            twin = saved.get(name)
            if twin is None:
                continue  # (a tied or derived weight the checkpoint keeps under one name)
            if twin.shape != value.shape or not torch.equal(twin.to(value.dtype), value):
                return f"final/ weight {name} is not the last checkpoint's"
        if not set(own) & set(saved):
            return f"no weight name of final/ is in the checkpoint ({sorted(saved)[:3]} ...)"
    if torch.equal(logits(start), logits(model)):
        return "final/ is the checkpoint the run started from (training changed nothing)"
    return "ok"


def compare_finals(run_dir: Path, reference: Path, base: Path) -> str:
    """"ok" when run_dir/final (loaded as a user loads it) has the weights of reference/final
    within FSDP_TOL while training moved them by more than 100x that; else what differs."""
    import torch
    import transformers as T

    T.AutoTokenizer.from_pretrained(run_dir / "final")
    own = T.AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    ref = T.AutoModelForCausalLM.from_pretrained(reference / "final").state_dict()
    start = T.AutoModelForCausalLM.from_pretrained(base).state_dict()
    if own.keys() != ref.keys():
        return f"final/ weights named differently from one process's: {sorted(own.keys() ^ ref.keys())[:4]}"
    gap, name = max(((own[k].float() - ref[k].float()).abs().max().item(), k) for k in own)
    moved = max((ref[k].float() - start[k].float()).abs().max().item() for k in ref)
    if gap > FSDP_TOL:
        return f"final/ weight {name} differs from one process's by {gap:.2e} (training moved weights by {moved:.2e})"
    if moved < 100 * FSDP_TOL:
        return f"training moved the weights by {moved:.2e} only: the comparison says nothing"
    return "ok"


def verdict(r: dict) -> str:
    if "skipped" in r:
        return "n/a"
    if "error" in r:
        return "error"
    if r.get("rc") == 2:
        return "refused"
    if r.get("rc") != 0 or not r.get("steps") or not r.get("finite"):
        return "failed"
    lo, hi = r["first_ratio"]
    on_policy = lo is None or (abs(lo - 1) < 1e-5 and abs(hi - 1) < 1e-5)
    if not ((r["mismatch_max"] or 0) < 1e-4 and on_policy):
        return "off-policy"
    return "ok" if r.get("final", "ok") == "ok" else "bad-final"


def tally(results: list[dict]) -> dict:
    return {v: sum(r["verdict"] == v for r in results) for v in ("ok", "refused", "off-policy", "bad-final", "failed",
                                                                 "error", "n/a")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                    help="default: default, share and gc (dense, hybrid); default, share, replay and gc-replay (MoE)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cell", nargs=3, metavar=("FAMILY", "MODE", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cell:  # (one cell, in a child process)
        print("CELL " + json.dumps(run_cell(a.cell[0], a.cell[1], Path(a.cell[2]))))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])]))
    results, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families:
            modes = a.modes or ["default", "share", *(["replay", "gc-replay"] if family in MOE else ["gc"])]
            for mode in modes:
                proc = subprocess.run([sys.executable, __file__, "--cell", family, mode, tmp], env=env,
                                      capture_output=True, text=True, timeout=600)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("CELL ")), None)
                r = json.loads(line[5:]) if line else {"family": family, "mode": mode,
                                                       "error": f"exit {proc.returncode}: {proc.stderr[-300:]}"}
                r["verdict"] = verdict(r)
                results.append(r)
                note = (r.get("message") or r.get("error") or r.get("skipped")
                        or ("" if r.get("final", "ok") == "ok" else r["final"]))
                print(f"{family:18s} {mode:8s} {r['verdict']:10s} mismatch {r.get('mismatch_max')!s:24s} {note}",
                      flush=True)
                if a.json:  # after every cell: a sweep stopped part-way keeps what it measured
                    a.json.write_text(json.dumps({"results": results, "counts": tally(results)}, indent=1))
    counts = tally(results)
    print(f"\n{len(results)} cells in {time.time() - t0:.0f} s: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
