"""bench/families.py: a tiny checkpoint of a family, saved and trained through the CLI, and the
verdict it reads off the run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from script_module import load_script

families = load_script("bench/families.py", "bench_families")


def test_a_family_trains_on_policy(tmp_path: Path, capsys):
    out = tmp_path / "families.json"
    assert families.main(["--families", "llama", "--modes", "default", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["family"], r["verdict"], r["steps"]) == ("llama", "ok", 4)
    assert r["mismatch_max"] < 1e-4
    assert "1 cells" in capsys.readouterr().out


def test_the_verdict_names_what_went_wrong():
    run = {"rc": 0, "steps": 4, "finite": True, "mismatch_max": 1e-6, "first_ratio": [1.0, 1.0]}
    assert families.verdict(run) == "ok"
    assert families.verdict({**run, "first_ratio": [None, None]}) == "ok"  # (no row had a nonzero advantage)
    assert families.verdict({**run, "mismatch_max": 0.15}) == "off-policy"  # a dropout in a trainer pass
    assert families.verdict({**run, "first_ratio": [0.98, 1.0]}) == "off-policy"
    assert families.verdict({**run, "finite": False}) == "failed"
    assert families.verdict({**run, "final": "final/ weight lm_head.weight is not the last checkpoint's"}) == "bad-final"
    assert families.verdict({"rc": 2, "message": "config field 'algo.routing_replay': ..."}) == "refused"
    assert families.verdict({"error": "RuntimeError: ..."}) == "error"


def test_the_final_check_reads_final_as_a_user_loads_it(tmp_path: Path):
    """check_final passes the trained model and names each way final/ can be wrong: the weights
    the run started from, a weight that is not the last checkpoint's, and a LoRA final/ that is
    not its base with final/adapter merged in."""
    import torch
    import transformers as T
    from safetensors.torch import save_file

    base, run = tmp_path / "base", tmp_path / "run"
    families.save_family(base, "llama")
    model = T.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)  # "trained"
    model.save_pretrained(run / "final")
    T.AutoTokenizer.from_pretrained(base).save_pretrained(run / "final")
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-4\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, run / "checkpoints" / "step-4" / "model.safetensors")
    assert families.check_final(run, base, lora=False) == "ok"

    state["model.norm.weight"] = state["model.norm.weight"] + 1e-3  # final/ is not what the run ended with
    save_file(state, run / "checkpoints" / "step-4" / "model.safetensors")
    assert families.check_final(run, base, lora=False) == "final/ weight model.norm.weight is not the last checkpoint's"

    T.AutoModelForCausalLM.from_pretrained(base).save_pretrained(run / "final")  # the untrained weights
    state = {k: v.contiguous() for k, v in T.AutoModelForCausalLM.from_pretrained(base).state_dict().items()}
    save_file(state, run / "checkpoints" / "step-4" / "model.safetensors")
    assert "training changed nothing" in families.check_final(run, base, lora=False)

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(T.AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(run / "final" / "adapter")
    peft_model.merge_and_unload().save_pretrained(run / "final")
    assert families.check_final(run, base, lora=True) == "ok"
    model.save_pretrained(run / "final")  # trained, but not with these adapters
    assert "not the base with final/adapter merged in" in families.check_final(run, base, lora=True)


def test_the_fsdp_check_compares_final_with_one_process(tmp_path: Path):
    """compare_finals passes two runs that agree and trained, and names a weight that differs and a
    comparison that cannot tell (training moved nothing)."""
    import torch
    import transformers as T

    base = tmp_path / "base"
    families.save_family(base, "llama")
    tok = T.AutoTokenizer.from_pretrained(base)

    def run(name: str, shift: float, extra: float = 0.0) -> Path:
        model = T.AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.add_(shift)
            model.model.norm.weight.add_(extra)
        model.save_pretrained(tmp_path / name / "final")
        tok.save_pretrained(tmp_path / name / "final")
        return tmp_path / name

    one, two = run("one", 0.01), run("two", 0.01, extra=3e-9)
    assert families.compare_finals(two, one, base) == "ok"
    three = run("three", 0.01, extra=1e-4)  # a weight that a rank did not update as one process does
    assert families.compare_finals(three, one, base).startswith("final/ weight model.norm.weight differs from one process's by 1.00e-04")
    assert "says nothing" in families.compare_finals(run("four", 0.0), run("five", 0.0), base)


def test_the_final_check_names_a_head_untied_from_a_tied_checkpoint(tmp_path: Path):
    import torch
    import transformers as T
    from safetensors.torch import save_file

    base, run = tmp_path / "base", tmp_path / "run"
    families.save_family(base, "llama", tied=True)
    assert families.tied(T.AutoModelForCausalLM.from_pretrained(base))
    model = T.AutoModelForCausalLM.from_pretrained(base)
    model.config.tie_word_embeddings = False  # the head written as a tensor of its own
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    model.save_pretrained(run / "final")
    T.AutoTokenizer.from_pretrained(base).save_pretrained(run / "final")
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-1")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, run / "checkpoints" / "step-1" / "model.safetensors")
    assert "head of its own" in families.check_final(run, base, lora=False)
