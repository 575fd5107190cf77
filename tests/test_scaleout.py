"""In-process pieces of the scale-out work: world-size rules, minibatch dealing across ranks,
LoRA end to end, bf16 autocast log-probs. (torchrun runs are in test_distributed.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from gspo.config import ConfigError, load_config, validate_world
from gspo.train.distributed import Dist
from gspo.models.logprobs import LogprobModule
from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.train import minibatches, train


@pytest.mark.parametrize("overrides, world, field", [
    (["rollout.prompts_per_step=6"], 4, "rollout.prompts_per_step"),
    (["rollout.prompts_per_step=6", "rollout.group_size=4", "rollout.batch_size=8"], 2, "rollout.batch_size"),
    (["rollout.prompts_per_step=2", "rollout.group_size=2", "schedule.num_minibatches=4"], 2, "schedule.num_minibatches"),
    (["rollout.prompts_per_step=4", "rollout.group_size=4", "schedule.num_minibatches=2",
      "schedule.micro_batch_size=8"], 2, "schedule.micro_batch_size"),
])
def test_world_size_rules_name_the_field(overrides, world, field):
    cfg = load_config(None, overrides)  # fine for one process
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_world(cfg, world)


def _ctx(world: int, rank: int, batch_size: int, M: int = 2, by: str = "row", G: int = 4):
    cfg = SimpleNamespace(seed=5, rollout=SimpleNamespace(batch_size=batch_size, group_size=G),
                          schedule=SimpleNamespace(num_minibatches=M, minibatch_by=by))
    return SimpleNamespace(cfg=cfg, dist=Dist(rank=rank, world_size=world))


@pytest.mark.parametrize("by", ["row", "group"])
@pytest.mark.parametrize("world", [2, 4])
def test_minibatches_union_over_ranks_is_the_one_process_minibatch(world, by):
    n, chunk = 32, 8
    one = minibatches(_ctx(1, 0, chunk, by=by), 3, n)
    share = n // world
    for k in range(2):
        ranks = [minibatches(_ctx(world, r, chunk, by=by), 3, share)[k] + r * share for r in range(world)]
        assert sorted(torch.cat(ranks).tolist()) == sorted(one[k].tolist())
    assert sorted(torch.cat(one).tolist()) == list(range(n))  # every row once per rollout
    assert minibatches(_ctx(1, 0, chunk, by=by), 4, n)[0].tolist() != one[0].tolist()  # reshuffled per rollout


def test_minibatches_by_group_keep_groups_together_in_random_order():
    n, G, M = 64, 8, 4
    plans = [minibatches(_ctx(1, 0, 0, M=M, by="group", G=G), r, n) for r in range(3)]
    for plan in plans:
        assert sorted(torch.cat(plan).tolist()) == list(range(n))
        for mb in plan:  # 2 whole groups per minibatch
            assert len(set((mb // G).tolist())) == n // G // M
    assert plans[0][0].tolist() != sorted(plans[0][0].tolist())  # rows shuffled within their groups
    assert [set((p[0] // G).tolist()) for p in plans] != [set((plans[0][0] // G).tolist())] * 3  # groups too
    # a chunk smaller than a group's minibatch share: consecutive parts of one group per minibatch
    small = minibatches(_ctx(1, 0, 0, M=4, by="group", G=8), 0, 16)
    assert all(len(set((mb // 8).tolist())) == 1 for mb in small)
    row = minibatches(_ctx(1, 0, 0, M=M, by="row", G=G), 0, n)
    assert any(len(set((mb // G).tolist())) > n // G // M for mb in row)  # row mode mixes groups


@pytest.mark.parametrize("G,chunk,n,M", [(3, 4, 12, 2), (4, 8, 16, 4), (5, 10, 20, 2), (8, 16, 32, 4)])
def test_minibatches_by_group_with_chunks_that_split_groups(G, chunk, n, M):
    """Groups that straddle sampling chunks, or that are larger than a minibatch's share of a
    chunk: every row once per rollout, and within each chunk's share of a minibatch a group's
    rows are consecutive (each group appears as one run)."""
    plan = minibatches(_ctx(1, 0, chunk, M=M, by="group", G=G), 0, n)
    assert sorted(torch.cat(plan).tolist()) == list(range(n))
    for mb in plan:
        for piece in mb.split(chunk // M):  # one chunk's share
            groups = (piece // G).tolist()
            runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
            assert len(runs) == len(set(runs)), groups


def test_logprob_module_bf16_autocast_close_to_fp32():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=0)
    ids = torch.randint(4, len(tok), (3, 12))
    mask = torch.ones_like(ids)
    fp32 = LogprobModule(model)(ids, mask, 6)
    bf16 = LogprobModule(model, autocast_dtype=torch.bfloat16)(ids, mask, 6)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)  # it really ran in bf16
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.02)


TINY = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=8",         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "rollout.temperature=1.5",
        "schedule.rollouts=2", "schedule.num_minibatches=2", "eval.num_prompts=4", "logging.console=false",
        "optim.lr=1e-2", "checkpoint.every=1", "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"]


def test_lora_end_to_end(tmp_path):
    """Only adapters train and are checkpointed; final/adapter holds them; final/ is the merged
    model, which transformers reloads and which computes what base + adapters compute."""
    import peft
    import transformers

    run = train(load_config(None, [*TINY, "lora.enabled=true", "lora.r=4", f"output.dir={tmp_path}"]))
    ck = load_file(run / "checkpoints" / "step-4" / "model.safetensors")
    assert ck and all("lora_" in k for k in ck)
    assert any(v.abs().max() > 0 for k, v in ck.items() if "lora_B" in k)  # the adapters moved

    tok = transformers.AutoTokenizer.from_pretrained(run / "final")
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "final")
    base = build_tiny_model(build_char_tokenizer("".join(sorted(__import__("gspo.tasks").tasks.TASK_CHARS))),
                            hidden_size=32, num_layers=1, seed=0, max_position_embeddings=516)
    adapted = peft.PeftModel.from_pretrained(base, run / "final" / "adapter")
    ids = torch.tensor([tok("12+3=")["input_ids"]])
    with torch.no_grad():
        a, b = merged(ids).logits, adapted(ids).logits
        plain = adapted.get_base_model()
        with adapted.disable_adapter():
            c = plain(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - c).abs().max() > 1e-4  # merged differs from the untrained base


@pytest.mark.parametrize("family, left_out", [("llama4", "feed_forward.router"), ("falcon_h1", "mamba.out_proj")])
def test_lora_all_linear_leaves_out_what_a_lora_layer_cannot_wrap(tmp_path, family, left_out):
    """Llama 4's router subclasses nn.Linear and returns scores and logits (a LoRA layer around it
    failed in the first forward); peft refuses a Mamba mixer's out_proj on Falcon-H1 (all-linear
    stopped the run). all-linear leaves both out and adapts the rest; naming them is one error."""
    import peft
    from archs import build_arch
    from artifacts import build_tokenizer

    from gspo.train.run import build_policy

    tok = build_tokenizer("qwen")
    build_arch(family, len(tok), tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "lora.enabled=true", "lora.r=2"])
    model, _ = build_policy(cfg, torch.device("cpu"))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert any(n.endswith("q_proj") for n in wrapped) and any(n.endswith("down_proj") for n in wrapped)
    assert not any(n.endswith(left_out) for n in wrapped)
    logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ConfigError, match=r"'lora.target_modules'"):
        build_policy(load_config(None, [f"model.name_or_path={tmp_path}", "lora.enabled=true",
                                        f"lora.target_modules=[q_proj,{left_out.split('.')[-1]}]"]), torch.device("cpu"))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_5", "falcon_h1", "llama4"])
def test_fsdp_finds_every_decoder_layer(family):
    """FSDP2 shards each decoder layer as a unit. Llama 4's get_decoder() returns the whole model,
    and torchrun stopped with 'cannot find the decoder layers to shard'."""
    from archs import build_arch
    from artifacts import build_tokenizer

    from gspo.train.distributed import decoder_layers

    tok = build_tokenizer("qwen")
    model = build_arch(family, len(tok), tok)
    layers = decoder_layers(model)
    assert len(layers) == 2 and all("DecoderLayer" in type(x).__name__ or "Block" in type(x).__name__ for x in layers)
