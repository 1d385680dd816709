"""course_lib.distributed.workers on two real gloo processes: DDP accumulation against one process's
whole batch, all-reduce counts, sharded model states against torch.chunk and the ZeRO formulas;
the course's training loop, train(no_sync=True), on a real DDP model. Starting the ranks, and
failing cleanly, is test_ranks.py."""

import contextlib
import math

import pytest
import torch
from process_tools import alive

from course_lib.distributed import workers
from course_lib.distributed.ranks import Ranks
from course_lib.model.gpt import GPT, GPTConfig, random_tokens
from course_lib.prediction.formulas import training_memory, zero3_memory
from course_lib.training.loop import batches_of, train

ODD = GPTConfig(vocab_size=257, seq_len=15, d_model=32, n_heads=2, n_layers=2)
WORLD, MICRO, K, STEPS, LR = 2, 2, 3, 2, 1e-2
TINY = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)


def _flat(tensors):
    return torch.cat([t.detach().flatten().clone() for t in tensors])


def _global_batch(step):
    return random_tokens(TINY, WORLD * MICRO * K, seed=step)


def _train_tiny(model, batches, accumulation_steps, **options):
    """train() on the tiny GPT in fp64: the gradient each optimizer step used, the final weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append(
        _flat(p.grad for p in model.parameters())))
    train(model, optimizer, batches, micro_batch_size=MICRO,
          accumulation_steps=accumulation_steps, **options)
    return grads, _flat(model.parameters())


def _train_through_the_loop(rank, world_size, *, no_sync):
    """A rank's part of STEPS steps of train(no_sync=...) on a real DDP model of the tiny GPT."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = GPT(TINY).double()
    ddp = DDP(model)  # the default 25 MB buckets: this model is a single one
    counter = workers._AllReduceCounter(ddp)
    per_step = []

    def count(step, loss):
        per_step.append((counter.calls, counter.bytes))
        counter.reset()

    batches = [batches_of(*_global_batch(step), MICRO * K)[rank] for step in range(STEPS)]
    grads, params = _train_tiny(ddp, batches, K, no_sync=no_sync, on_step=count)
    return {"grads": grads, "params": params, "per_step": per_step}


def _learner_worker(rank, world_size):
    """STEPS steps of lecture 07's DDP loop as a learner writes it, without the course's train()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(GPT(TINY).double())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batches_of(*_global_batch(step), MICRO * K)[rank]
        for k, (xk, yk) in enumerate(batches_of(x, y, MICRO)):
            with model.no_sync() if k < K - 1 else contextlib.nullcontext():
                (model(xk, yk)[1] / K).backward()
        optimizer.step()
        optimizer.zero_grad()


def _fsdp_learner_worker(rank, world_size):
    """Lecture 07's FSDP2 worker as a learner writes it: four AdamW steps of the ODD GPT."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(ODD)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(4):
        x, y = random_tokens(ODD, MICRO, seed=10 * step + rank)
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def ranks_results():
    with Ranks(WORLD, timeout=300) as ranks:
        demo = ranks.run(workers.all_reduce_demo)
        states = ranks.run(workers.sharded_states, config=ODD)
        trained = {no_sync: ranks.run(_train_through_the_loop, no_sync=no_sync)
                   for no_sync in (True, False)}
        recorded = workers.record_steps(ranks, _learner_worker)
        fsdp = workers.record_steps(ranks, _fsdp_learner_worker)
        unwatched = ranks.run(workers._stop_watching)
        pids = ranks.pids
    return {"demo": demo, "states": states, "trained": trained,
            "recorded": recorded, "fsdp": fsdp, "unwatched": unwatched, "pids": pids}


def test_all_reduce_sums_in_place_on_every_rank(ranks_results):
    demo = ranks_results["demo"]
    total = sum(r["before"] for r in demo)
    assert [r["rank"] for r in demo] == [0, 1]
    assert all(torch.equal(r["after"], total) for r in demo)
    assert len({r["pid"] for r in demo}) == WORLD


def test_record_steps_sees_each_step_of_a_learners_own_loop(ranks_results):
    """What the hooks record from a plain PyTorch loop is what train(no_sync=True) measured."""
    for rank, steps in enumerate(ranks_results["recorded"]):
        ours = ranks_results["trained"][True][rank]
        assert len(steps) == STEPS
        assert [(s["all_reduces"], s["bytes"]) for s in steps] == ours["per_step"]
        for step, grad in zip(steps, ours["grads"]):
            assert torch.allclose(step["grads"].double(), grad, rtol=1e-5, atol=1e-9)
        assert torch.allclose(steps[-1]["params"].double(), ours["params"], rtol=1e-5, atol=1e-8)
        assert steps[-1]["states"]["parameters"] == 8 * ours["params"].numel()  # fp64, unsharded
    assert ranks_results["unwatched"] == [[], []]  # the hooks are gone after the run


def test_record_steps_wants_ranks():
    with pytest.raises(TypeError, match="ranks"):
        workers.record_steps(None, workers.all_reduce_demo)


def test_ranks_are_gone_after_close(ranks_results):
    assert not any(alive(pid) for pid in ranks_results["pids"])


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "sync_every_micro_batch"])
def test_train_with_ddp_equals_one_process_accumulating_the_whole_batch(ranks_results, no_sync):
    torch.manual_seed(0)
    model = GPT(TINY).double()
    P = sum(p.numel() for p in model.parameters())
    grads, params = _train_tiny(model, [_global_batch(step) for step in range(STEPS)],
                                WORLD * K)
    r0, r1 = ranks_results["trained"][no_sync]
    # One all-reduce of the whole fp64 gradient (one bucket) per synchronising backward: once per
    # optimizer step with no_sync, after every micro-batch without it.
    syncs = 1 if no_sync else K
    assert r0["per_step"] == r1["per_step"] == [(syncs, syncs * 8 * P)] * STEPS
    assert len(r0["grads"]) == len(grads) == STEPS
    for step, grad in enumerate(grads):
        assert torch.equal(r0["grads"][step], r1["grads"][step]), step
        assert torch.allclose(r0["grads"][step], grad, rtol=1e-10, atol=1e-13), step
    assert torch.equal(r0["params"], r1["params"])
    assert (r0["params"] - params).abs().max() < 1e-10


def test_fsdp_shards_are_torch_chunks(ranks_results):
    states = ranks_results["states"]
    full = {name: shape for name, (shape, _) in states[0]["fsdp_rows"].items()}
    for name, shape in full.items():
        chunks = torch.empty(shape, device="meta").chunk(WORLD, dim=0)
        for rank in range(WORLD):
            local = states[rank]["fsdp_rows"][name][1]
            expect = tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])
            assert local == expect, (name, rank)


def test_sharded_states_against_the_zero_formulas(ranks_results):
    states = ranks_results["states"]
    P = states[0]["n_params"]
    N = WORLD

    def formula(stage):
        return training_memory(P, optimizer="adamw", precision="fp32", zero_stage=stage,
                               world_size=N)

    for s in states:
        # DDP: 16P in .grad, params and moments; its buckets are a second copy of the gradients.
        assert s["ddp_grad_view"]["total"] == formula(0).total == 16 * P
        assert s["ddp"]["gradients"] == 8 * P and s["ddp_bucket_bytes"] == 4 * P
        # ZeRO-1: full params and grads, a share of the moments.
        assert s["zero1"]["parameters"] == s["zero1"]["gradients"] == 4 * P
    # Every element's moments live on exactly one rank.
    assert sum(s["zero1"]["optimizer_state"] for s in states) == 8 * P
    assert sum(s["fsdp"]["logical"]["parameters"] for s in states) == 4 * P
    assert sum(s["fsdp"]["logical"]["optimizer_state"] for s in states) == 8 * P
    # FSDP2: within a row per tensor of 16 * ceil(P/N); padded storage never below the logical.
    rows = states[0]["fsdp_rows"]
    slack = 16 * sum(math.prod(shape[1:]) for shape, _ in rows.values())
    for s in states:
        assert abs(s["fsdp"]["total"] - formula(3).total) <= slack
        assert s["fsdp"]["parameters"] >= s["fsdp"]["logical"]["parameters"]
    # pos_emb has 15 rows: rank 1 holds 7 of them in an 8-row buffer.
    assert states[1]["fsdp"]["parameters"] - states[1]["fsdp"]["logical"]["parameters"] >= 4 * ODD.d_model


def test_fsdp_step_holds_the_gathered_units_of_zero3_memory(ranks_results):
    """During a step after the first (the least over three): the root and two blocks gathered
    (a padded row per tensor at most), two blocks' gradients (unsharded, and their
    reduce-scatter copy); the root's gradients are the tracker's temporaries until their
    reduce-scatter."""
    between = zero3_memory(ODD, world_size=WORLD, during_step=False)
    during = zero3_memory(ODD, world_size=WORLD)
    root = sum(p.numel() for n, p in GPT(ODD).named_parameters() if not n.startswith("blocks."))
    rows = 4 * ODD.d_model * len(list(GPT(ODD).parameters()))
    for steps in ranks_results["fsdp"]:
        assert "during" not in steps[0] and all("during" in s for s in steps[1:])
        held = {k: min(s["during"][k] for s in steps[1:]) for k in steps[1]["during"]}
        states = steps[-1]["states"]["total"]
        assert 0 <= held["gathered"] - (during.parameters - between.parameters) <= rows
        assert held["unsharded gradients"] == during.gradients - between.gradients - 4 * root
        assert states < held["held"] <= during.total and held["held"] < held["peak"]


def test_local_bytes_counts_views_once_and_reports_logical_bytes():
    base = torch.zeros(10, 4)
    logical, allocated = workers._local_bytes([base[:5], base[5:]])
    assert logical == 10 * 4 * 4 and allocated == 10 * 4 * 4
    logical, allocated = workers._local_bytes([base[:3]])
    assert logical == 3 * 4 * 4 and allocated == 10 * 4 * 4
