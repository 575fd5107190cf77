"""gspo.data's PromptStream (deterministic epochs, resume, ranks) and gspo.tasks' built-in tasks."""

import json

import pytest

from gspo.data import DataError, PromptStream
from gspo.tasks import TASK_CHARS, TASKS, arithmetic, make_task, sorting


# ------------------------------------------------------------------------------ sampler

ROWS100 = [{"prompt": f"p{i}", "i": i} for i in range(100)]


def ids(batch):
    return [r["i"] for r in batch]


def test_sampler_deterministic_and_epochs_are_permutations():
    a = PromptStream(ROWS100, 8, seed=3)
    b = PromptStream(ROWS100, 8, seed=3)
    first = [ids(a.next_batch()) for _ in range(12)]
    assert first == [ids(b.next_batch()) for _ in range(12)]
    epoch0 = sum(first[:12], [])
    assert len(set(epoch0)) == 96  # 12 batches of 8 = 96 distinct rows, 4 dropped
    assert a.epoch == 0 and a.position == 96
    epoch1 = sum((ids(a.next_batch()) for _ in range(12)), [])
    assert a.epoch == 1 and len(set(epoch1)) == 96 and epoch1 != epoch0
    assert ids(PromptStream(ROWS100, 8, seed=4).next_batch()) != first[0]


def test_sampler_no_shuffle_in_order():
    s = PromptStream(ROWS100, 30, seed=0, shuffle=False)
    assert [ids(s.next_batch())[0] for _ in range(4)] == [0, 30, 60, 90]  # epoch 1 starts with the 10 rows epoch 0 left
    assert s.epoch == 1


@pytest.mark.parametrize("stop", [0, 5, 11, 12, 13, 30])  # 12 steps per epoch: 11-13 straddle the boundary
def test_sampler_resume_equals_uninterrupted(stop):
    ref = PromptStream(ROWS100, 8, seed=7)
    expected = [ids(ref.next_batch()) for _ in range(stop + 20)]
    s = PromptStream(ROWS100, 8, seed=7)
    for _ in range(stop):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))
    assert all(type(v) is int for k, v in state.items() if k != "data_sha256")  # (and the rows' sha256)
    resumed = PromptStream(ROWS100, 8, seed=7)
    resumed.load_state_dict(state)
    assert [ids(resumed.next_batch()) for _ in range(20)] == expected[stop:]


def test_without_shuffling_every_row_is_drawn_over_the_epochs():
    """10 rows, batches of 4: an epoch deals 8 and skips 2; without shuffling the 2 skipped rows
    start the next epoch, which goes on in file order."""
    s = PromptStream(ROWS100[:10], 4, seed=7, shuffle=False)
    ids = lambda b: [r["prompt"] for r in b]  # noqa: E731
    got = [ids(s.next_batch()) for _ in range(4)]
    assert got[:2] == [ids(ROWS100[0:4]), ids(ROWS100[4:8])]
    assert got[2:] == [ids(ROWS100[8:10] + ROWS100[0:2]), ids(ROWS100[2:6])]
    seen = {p for _ in range(20) for p in ids(s.next_batch())}
    assert seen == set(ids(ROWS100[:10]))


def test_sampler_load_state_rejects_other_settings():
    state = PromptStream(ROWS100, 8, seed=7).state_dict()
    with pytest.raises(DataError, match="config field 'rollout.prompts_per_step': .*batch_size=8, this run batch_size=4"):
        PromptStream(ROWS100, 4, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="config field 'data.source': the resumed run's prompt stream draws from 100 "
                                       "prompts, this data has 50"):
        PromptStream(ROWS100[:50], 8, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match="^the resumed run's prompt stream was split over 1 processes, this run has 2"):
        PromptStream(ROWS100, 8, seed=7, rank=1, world_size=2).load_state_dict(state)
    two = PromptStream(ROWS100, 4, seed=7, rank=0, world_size=2).state_dict()  # a 2-process run, 4 rows each
    with pytest.raises(DataError, match="^the resumed run's prompt stream was split over 2 processes, this run has 1"):
        PromptStream(ROWS100, 8, seed=7).load_state_dict(two)  # the process count, not the batch, is the cause


def test_sampler_ranks_disjoint_and_cover_global_batch():
    world = 3
    samplers = [PromptStream(ROWS100, 5, seed=1, rank=r, world_size=world) for r in range(world)]
    single = PromptStream(ROWS100, 15, seed=1)
    for _ in range(14):  # crosses the epoch boundary (6 global steps per epoch)
        per_rank = [ids(s.next_batch()) for s in samplers]
        assert sum(per_rank, []) == ids(single.next_batch())
        assert len(set(sum(per_rank, []))) == 15


def test_sampler_errors():
    with pytest.raises(DataError, match=r"4 rows, fewer than one global batch.*2 x world_size 3"):
        PromptStream(ROWS100[:4], 2, seed=0, world_size=3)
    with pytest.raises(DataError, match="rank"):
        PromptStream(ROWS100, 2, seed=0, rank=2, world_size=2)
    with pytest.raises(DataError, match="batch_size"):
        PromptStream(ROWS100, 0, seed=0)


# ------------------------------------------------------------------------------ tasks


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arithmetic_answers_correct_and_deterministic(difficulty):
    rows = arithmetic(300, seed=5, difficulty=difficulty)
    assert rows == arithmetic(300, seed=5, difficulty=difficulty)
    assert rows != arithmetic(300, seed=6, difficulty=difficulty)
    for r in rows:
        expr = r["prompt"]
        assert expr.endswith("=") and set(expr + r["answer"]) <= TASK_CHARS
        assert int(r["answer"]) == eval(expr[:-1])  # noqa: S307 - digits and + - * only
    ops = {next(c for c in r["prompt"][1:] if c in "+-*") for r in rows}
    assert ops == {1: {"+"}, 2: {"+", "-"}, 3: {"+", "-", "*"}}[difficulty]


def test_arithmetic_ranges():
    assert all(max(map(int, r["prompt"][:-1].split("+"))) <= 99 for r in arithmetic(200, seed=0))
    for r in arithmetic(200, seed=0, difficulty=3):
        if "*" in r["prompt"]:
            assert len(r["answer"]) <= 4


@pytest.mark.parametrize("difficulty,lengths", [(1, {3, 4}), (2, {5, 6}), (3, {7, 8})])
def test_sorting(difficulty, lengths):
    rows = sorting(200, seed=1, difficulty=difficulty)
    assert rows == make_task("sorting", 200, seed=1, difficulty=difficulty)
    for r in rows:
        digits = r["prompt"][len("sort:"):-1]
        assert r["prompt"] == f"sort:{digits}=" and r["answer"] == "".join(sorted(digits))
        assert set(r["prompt"] + r["answer"]) <= TASK_CHARS
    assert {len(r["answer"]) for r in rows} == lengths


def test_tasks_registry_and_errors():
    assert set(TASKS) == {"arithmetic", "sorting", "multiply", "guess"}  # the last two: multi-turn (tool_tasks)
    with pytest.raises(DataError, match=r"unknown task 'nope'; known tasks: arithmetic, guess, multiply, sorting"):
        make_task("nope", 3, seed=0)
    with pytest.raises(DataError, match="difficulty"):
        make_task("arithmetic", 3, seed=0, difficulty=4)
    with pytest.raises(DataError, match="n must be"):
        arithmetic(0, seed=0)
