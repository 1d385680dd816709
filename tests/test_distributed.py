"""course_lib.distributed on two real gloo processes: DDP accumulation against one process's
whole batch, all-reduce counts, sharded model states against torch.chunk and the ZeRO formulas.
Starting the ranks, and failing cleanly, is test_ranks.py."""

import math

import pytest
import torch
from process_tools import alive

from course_lib import distributed
from course_lib.memory import training_memory
from course_lib.models import GPT, GPTConfig, random_tokens
from course_lib.ranks import Ranks

CONFIG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=2, n_layers=2)
ODD = GPTConfig(vocab_size=257, seq_len=15, d_model=32, n_heads=2, n_layers=2)
WORLD, MICRO, K, STEPS, LR = 2, 2, 3, 2, 1e-2


@pytest.fixture(scope="module")
def ranks_results():
    with Ranks(WORLD, timeout=300) as ranks:
        demo = ranks.run(distributed.all_reduce_demo)
        accumulation = ranks.run(distributed.ddp_accumulation, config=CONFIG, micro_batch=MICRO,
                                 accum_steps=K, steps=STEPS, lr=LR, seed=0, bucket_cap_mb=0.03)
        states = ranks.run(distributed.sharded_states, config=ODD)
        pids = ranks.pids
    return {"demo": demo, "acc": accumulation, "states": states, "pids": pids}


def _whole_batch(steps):
    """One process, the whole batch of WORLD * MICRO * K at once: gradient, then trained weights."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    x, y = random_tokens(CONFIG, WORLD * MICRO * K, seed=0)
    model(x, y)[1].backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = random_tokens(CONFIG, WORLD * MICRO * K, seed=step)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return grad, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_all_reduce_sums_in_place_on_every_rank(ranks_results):
    demo = ranks_results["demo"]
    total = sum(r["before"] for r in demo)
    assert [r["rank"] for r in demo] == [0, 1]
    assert all(torch.equal(r["after"], total) for r in demo)
    assert len({r["pid"] for r in demo}) == WORLD


def test_ranks_are_gone_after_close(ranks_results):
    assert not any(alive(pid) for pid in ranks_results["pids"])


def test_ddp_accumulation_equals_the_whole_batch(ranks_results):
    grad, trained = _whole_batch(STEPS)
    r0, r1 = ranks_results["acc"]
    for name in ("no_sync", "sync_every_micro_batch", "manual"):
        assert torch.allclose(r0[name]["grads"], grad, rtol=1e-4, atol=1e-6), name
        assert torch.equal(r0[name]["grads"], r1[name]["grads"]), name
    assert torch.allclose(r0["loss_over_K_times_N"]["grads"], grad / WORLD, rtol=1e-4, atol=1e-7)
    assert torch.allclose(r0["loss_not_divided"]["grads"], grad * K, rtol=1e-4, atol=1e-5)
    assert torch.equal(r0["params_after"], r1["params_after"])
    moved = (trained - torch.cat([p.detach().flatten() for p in GPT(CONFIG).parameters()])).abs()
    assert (r0["params_after"] - trained).abs().max() < 0.01 * moved.max()


def test_no_sync_all_reduces_once_per_bucket_per_step(ranks_results):
    r0 = ranks_results["acc"][0]
    P = r0["n_params"]
    buckets = r0["no_sync"]["all_reduces"]
    assert buckets > 1  # bucket_cap_mb=0.03 splits even this small model
    assert r0["sync_every_micro_batch"]["all_reduces"] == K * buckets
    assert r0["no_sync"]["bytes"] == 4 * P
    assert r0["sync_every_micro_batch"]["bytes"] == K * 4 * P


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
        assert s["ddp"]["grads"] == 8 * P and s["ddp_bucket_bytes"] == 4 * P
        # ZeRO-1: full params and grads, a share of the moments.
        assert s["zero1"]["params"] == s["zero1"]["grads"] == 4 * P
    # Every element's moments live on exactly one rank.
    assert sum(s["zero1"]["optimizer_states"] for s in states) == 8 * P
    assert sum(s["fsdp"]["logical"]["params"] for s in states) == 4 * P
    assert sum(s["fsdp"]["logical"]["optimizer_states"] for s in states) == 8 * P
    # FSDP2: within a row per tensor of 16 * ceil(P/N); padded storage never below the logical.
    rows = states[0]["fsdp_rows"]
    slack = 16 * sum(math.prod(shape[1:]) for shape, _ in rows.values())
    for s in states:
        assert abs(s["fsdp"]["total"] - formula(3).total) <= slack
        assert s["fsdp"]["params"] >= s["fsdp"]["logical"]["params"]
    # pos_emb has 15 rows: rank 1 holds 7 of them in an 8-row buffer.
    assert states[1]["fsdp"]["params"] - states[1]["fsdp"]["logical"]["params"] >= 4 * ODD.d_model


def test_average_gradients_by_hand():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    # Three ranks holding the same gradient: the sum is 3x, the mean is the gradient itself.
    distributed.average_gradients(params, lambda t: t.mul_(3), 3)
    assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0, 3.0]))
    assert params[1].grad is None
    with pytest.raises(ValueError, match="world_size"):
        distributed.average_gradients(params, lambda t: t, 0)


def test_local_bytes_counts_views_once_and_reports_logical_bytes():
    base = torch.zeros(10, 4)
    logical, allocated = distributed.local_bytes([base[:5], base[5:]])
    assert logical == 10 * 4 * 4 and allocated == 10 * 4 * 4
    logical, allocated = distributed.local_bytes([base[:3]])
    assert logical == 3 * 4 * 4 and allocated == 10 * 4 * 4


def test_counter_needs_a_ddp_model():
    with pytest.raises(ValueError, match="ddp_model"):
        distributed.AllReduceCounter(torch.nn.Linear(2, 2))
