"""The fake Ascend device itself (tests/fakes/torch_npu/device.py): it must catch what a real device
would punish, or the tests that run afd on it prove nothing. Each script in a process of its own
(tests/rank_processes.py): the fake renames PyTorch's PrivateUse1 backend, which is process-wide."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rank_processes import run

FAKES = str(Path(__file__).parent / "fakes")

SCRIPT = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {fakes!r})
    import torch, torch_npu
    from torch_npu.device import HazardError, STATS

    def raises(fn, match):
        try:
            fn()
        except (RuntimeError, TypeError) as e:
            assert match in str(e), e
            return
        raise AssertionError(f"no error, expected {{match!r}}")

    # a device of its own: mixing with the host fails, as on the device
    torch.npu.set_device(1)
    x = torch.ones(4, device="npu:1")
    raises(lambda: x + torch.ones(4), "same device")
    raises(lambda: x + torch.ones(4, device="npu:2"), "same device")
    assert (x * 2).cpu().tolist() == [2.0] * 4 and STATS["host_reads"] >= 1

    # views write through to their base, in-place ops hand back the same tensor
    buf = torch.zeros(4, 2, device="npu:1")
    buf[1:3].add_(1)
    assert buf.sum().item() == 4.0

    # the old side-stream pattern, in a thread that never bound npu:1: the event is recorded on npu:0's
    # stream, so the side stream is not ordered after the write it is about to read
    m = torch.empty(8, device="npu:1")
    def old_send():
        m.fill_(3)                                   # pre_moe writes m on npu:1's current stream
        ready = torch.npu.Event(); ready.record()    # current device is 0 in this thread
        side = torch.npu.Stream(device=1)
        with torch.npu.stream(side):
            side.wait_event(ready)
            torch_npu.device.access(side, [m], [], "isend(m)")
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(old_send)))
    def _catch(fn):
        try:
            fn()
        except HazardError as e:
            return str(e)
    t.start(); t.join()
    assert errors[0] and "reads memory written by fill_" in errors[0], errors
    assert any("never" in u for u in STATS["unbound"]), STATS["unbound"]

    # the same, bound and ordered: no hazard
    def new_send():
        torch.npu.set_device(1)
        m.fill_(4)
        side = torch.npu.Stream(device=1)
        side.wait_stream(torch.npu.current_stream(1))
        torch_npu.device.access(side, [m], [], "isend(m)")
        return True
    assert new_send()

    # a receive into a buffer still being read elsewhere is a write-after-read hazard
    y = torch.ones(8, device="npu:1")
    written = torch.npu.Event(); written.record(torch.npu.current_stream(1))
    (y + 1).sum()                                    # read on the current stream, after the event
    comm = torch.npu.Stream(device=1)
    comm.wait_event(written)                         # ordered after the write, not after the read
    raises(lambda: torch_npu.device.access(comm, [], [y], "irecv(y)"), "may still be reading")

    # torch_npu's generators: one of the device reproduces its seed; a CPU one on an npu op is refused,
    # as ATen's check_generator refuses it
    def draw(gen):
        return torch.empty(6, device="npu:1").exponential_(generator=gen).cpu()
    g = torch.Generator(device="npu:1").manual_seed(5)
    assert isinstance(g, torch.Generator) and g.device == torch.device("npu:1")
    assert torch.equal(draw(g), draw(torch.Generator(device="npu:1").manual_seed(5)))
    raises(lambda: draw(torch.Generator().manual_seed(9)), "Expected a 'npu' device type for generator")

    # multinomial checks its input on the host before it draws
    n = STATS["host_syncs"]
    torch.multinomial(torch.ones(4, device="npu:1"), 1)
    assert STATS["host_syncs"] == n + 1

    # so does every op whose output size is a device value; a fixed size or a scatter does not wait
    v = torch.tensor([0, 2, 0, 1], device="npu:1")
    for op in (torch.nonzero, torch.bincount, torch.unique, lambda t: t[t > 0], lambda t: t.repeat_interleave(t)):
        n = STATS["host_syncs"]
        op(v)
        assert STATS["host_syncs"] == n + 1, op
    n = STATS["host_syncs"]
    torch.zeros(3, dtype=torch.long, device="npu:1").index_add_(0, v, torch.ones_like(v))
    v.repeat_interleave(v, output_size=3)
    assert STATS["host_syncs"] == n

    # a device-to-host copy waits for the device unless it is non_blocking into pinned memory
    counts = torch.arange(4, device="npu:1")
    n = STATS["host_syncs"]
    pinned = torch.empty(4, dtype=torch.int64).pin_memory()
    pinned.copy_(counts, non_blocking=True)
    assert STATS["host_syncs"] == n and pinned.tolist() == [0, 1, 2, 3]
    torch.empty(4, dtype=torch.int64).copy_(counts, non_blocking=True)  # pageable: the host waits
    torch.empty(4, dtype=torch.int64).copy_(counts)
    assert STATS["host_syncs"] == n + 2, STATS["host_sync_sites"]
    print("OK")
""")

SAMPLER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {fakes!r})
    import torch, torch_npu
    from torch_npu.device import STATS
    from afd.engine.logits import History
    from afd.engine.sampling import Row, Sampler, SamplingParams

    P = SamplingParams

    def batch(drafts):  # drafts: the MTP drafts, never read on the host where they are on the device
        return [
            Row(P(), "greedy", History([1], [2])),
            Row(P(temperature=0.9, top_k=20, top_p=0.8, seed=3, logprobs=2), "hot", History([1], [2])),
            Row(P(temperature=1.2, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                  logit_bias={{4: 3.0}}, min_tokens=5, stop_token_ids=(7,), seed=11), "pen", History([1, 4], [4, 9])),
            Row(P(temperature=0.7, seed=5), "spec", History([3], []), draft=0),  # a draft, then its bonus row
            Row(P(temperature=0.7, seed=5, presence_penalty=0.4), "spec", History([3], [], drafts[:1])),
            Row(P(temperature=1.0), "unseeded", History([1], [])),
        ]

    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3

    def run(x, drafts):
        sampler = Sampler(eos_ids=(2,))
        torch.manual_seed(1)  # the unseeded row: the fake draws on the host's default generator
        return [sampler.draw(x, batch(drafts), drafts) for _ in range(3)]

    drafts = torch.tensor([6])
    want = run(logits, drafts)
    torch.npu.set_device(1)
    x = logits.pin_memory().to("npu:1", non_blocking=True)
    d = drafts.pin_memory().to("npu:1", non_blocking=True)
    n = STATS["host_syncs"]
    got = run(x, d)
    assert STATS["host_syncs"] - n == 3, STATS["host_sync_sites"]  # one read per batch, every field in it
    assert got == want, (got, want)
    print("OK")
""")


def test_the_fake_device_catches_what_a_device_punishes():
    (out,) = run(SCRIPT.format(fakes=FAKES), [[]], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.output


def test_the_sampler_reads_the_host_once_per_batch_and_draws_as_on_the_cpu():
    """Every sampling field in one batch on the fake device: one host read per draw, and the tokens and
    logprobs of the same batch on the CPU (the fake computes on the host; seeded rows use their own
    generators, the unseeded one the default generator, seeded alike for both runs)."""
    (out,) = run(SAMPLER.format(fakes=FAKES), [[]], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.output
