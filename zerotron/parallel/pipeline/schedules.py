"""Pipeline schedules as data: per-rank action lists and a checker.

Pure functions, no process groups. Model stage of (rank r, chunk c) is ``c*pp + r`` (Megatron-LM
interleaving, Narayanan et al. 2021); with ``virtual_stages == 1`` chunk is always 0 and stage == r.

Kinds: "naive" (one batch, no micro-batching), "gpipe" (Huang et al. 2019: all forwards, then all
backwards), "1f1b" (PipeDream-Flush, Narayanan et al. 2021: warm-up forwards, steady one-forward-
one-backward, cool-down backwards), "interleaved" (Megatron-LM interleaved 1F1B, Narayanan et al.
2021 "Efficient Large-Scale Language Model Training on GPU Clusters", v chunks per rank), "zb-h1"
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241: 1F1B with the backward split
into B, the gradient w.r.t. the stage input, sent upstream at once, and W, the weight gradients,
run later to fill what would be the cool-down bubble), "zb-v" (Qi et al. 2024, sec. 6, ZB-V: two
chunks per rank placed in a V, rank r holding model stages r and 2p-1-r, so the first and the last
stage live on rank 0 and the turn at stage p-1 -> p stays on rank p-1; B and W split as in zb-h1).

Placement (``zerotron.stages.Placement``): model stage of (rank r, chunk c) is ``c*pp + r`` (the
loop) for every kind but zb-v, whose V placement is ``r`` for c = 0 and ``2*pp-1-r`` for c = 1.
:func:`build_schedule` returns a :class:`Schedule`, which carries its placement, so the functions
that read a schedule (:func:`check_schedule`, ``simulation.simulate``) need no flag for it; a plain list of
rank lists is read with the loop placement.

Computes: "F" (forward), "B" (backward; for every kind but zb-h1 the whole backward, for zb-h1 only
the input gradient) and "W" (weight gradients of a B that had them split off; only zb-h1 has W).

The event simulator and the bubble theory (idle time per rank under each kind) live in
``pipeline.simulation``.

Why there is no ZB-H2 here: with one synchronous optimizer step per flush (zerotron clips by the
global gradient norm, so every rank waits for every gradient), no schedule over these stages can
idle less than (p-1) T_F / v per rank for uniform stage costs: the last stage cannot start before
its first forward has crossed the p-1 stages in front of it (v chunks: p-1 chunk forwards of
T_F / v), and all ranks share one makespan. ZB-H1 attains that bound whenever T_W >= T_B, so
ZB-H2 (Qi et al. 2024, sec. 3.2: 2p-1 micro-batches of activations on rank 0 instead of p) could
only gain (p-1) max(T_B - T_W, 0); its "zero" bubble needs their optimizer post-validation, which
lets the next iteration's warm-up overlap this one's tail. Tested: ``test_schedules``.

Communication convention (what an executor may assume):

* Computes come in *groups*: a single F or B, except in the interleaved steady state where a group
  is an F-B pair (Megatron-LM's send_forward_backward_recv_forward_backward step). Between two
  groups, and before the first / after the last, there is exactly one *comm run* (a maximal run of
  consecutive SEND/RECV actions): first the SENDs of every cross-rank output of the previous group,
  then the RECVs of every cross-rank input of the next group, each in compute order. So a RECV is
  posted before the compute that needs it (at most one other compute in between, of the same
  group) and a SEND right after the group that produced it. For naive, GPipe and 1F1B every group
  is one compute, i.e. RECV immediately before its compute and SEND immediately after.
* The executor posts each comm run as ONE batch (``batch_isend_irecv``, ops in list order) and
  waits for its RECVs before the next compute (its SENDs complete in the background and are waited
  for at the end of the walk). Waiting for every op instead cannot deadlock either, even if a send
  completes only once its receiver has posted the matching recv (rendezvous, as inside an NCCL
  group): ``simulate`` models exactly that and raises on deadlock; ``simulate(...,
  eager_sends=True)`` gives the timing of the executor (zb-h1 needs it: a rank runs its W while
  the B gradient it sent waits for the upstream rank's recv). Executing the ops of one run one at a time with blocking calls is NOT safe (e.g. 1F1B pairs
  SEND_F with RECV_B on the same neighbour, like Megatron-LM's send_forward_recv_backward).
* Messages between an ordered pair of ranks are posted in the same order by sender and receiver
  (FIFO, over both directions F and B), so order-based matching (NCCL, gloo without tags) is right.
  Received tensors are kept by (direction, microbatch, chunk) until their compute.
* ``chunk`` of a SEND/RECV is the local chunk of the compute that produces/consumes the tensor.
  A hand-off between stages on the same rank (only when pp == 1) is local: no SEND/RECV.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.parallel.pipeline.zb_v_order import zb_v_groups
from zerotron.stages import Placement

KINDS = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: a compute ("F", "B", "W") or a p2p op ("SEND_F", "RECV_F",
    "SEND_B", "RECV_B"; F = activations downstream, B = gradients upstream) for ``microbatch``
    on the rank's local ``chunk``; ``peer`` is the other rank of a SEND/RECV (None for computes)."""

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None


def _compute_groups(pp: int, m: int, kind: str, v: int, rank: int) -> list[list[tuple]]:
    """Computes (kind, microbatch, chunk) of ``rank`` in execution order, grouped: comm runs sit
    only between groups. A group is one compute, or an F-B pair in the interleaved steady state."""
    if kind in ("naive", "gpipe"):
        # Clock-cycle view (GPipe): at clock k micro-batch i is on stage k-i going forward, and on
        # stage (pp-1)-(k-i) going backward; per stage that is F0..F(m-1) then B0..B(m-1).
        return [[("F", i, 0)] for i in range(m)] + [[("B", i, 0)] for i in range(m)]
    if kind == "zb-h1":
        return _zb_h1_groups(pp, m, rank)
    if kind == "1f1b":  # PipeDream-Flush: warm-up min(pp-r-1, m) forwards, 1F1B, cool-down
        warm = min(pp - rank - 1, m)
        groups = [[("F", i, 0)] for i in range(warm)]
        for i in range(m - warm):
            groups += [[("F", warm + i, 0)], [("B", i, 0)]]
        return groups + [[("B", i, 0)] for i in range(m - warm, m)]
    # Megatron-LM interleaved 1F1B: "virtual micro-batch" k in 0..m*v-1 walks groups of pp
    # micro-batches through chunk 0, then the same group through chunk 1, ...; backwards visit the
    # chunks in reverse. Warm-up (Narayanan et al. 2021 / Megatron-LM): 2*(pp-r-1) + (v-1)*pp.
    total = m * v

    def unit(k: int, forward: bool) -> tuple:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return ("F" if forward else "B", group * pp + k % pp, chunk if forward else v - 1 - chunk)

    warm = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    groups = [[unit(k, True)] for k in range(warm)]
    groups += [[unit(warm + k, True), unit(k, False)] for k in range(total - warm)]
    return groups + [[unit(k, False)] for k in range(total - warm, total)]


def _zb_h1_groups(pp: int, m: int, rank: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2024, fig. 3): 1F1B's warm-up min(pp-r-1, m) forwards and its F/B order,
    each W deferred: in the steady state rank r runs the W of micro-batch k-r after B(k) (it holds
    at most pp-r-1 + 1 + r = pp micro-batches, the 1F1B peak), in the cool-down one W after each B
    but the last, then the remaining r+1 W's, which fill the time 1F1B's rank r waits for B's."""
    warm = min(pp - rank - 1, m)
    groups = [[("F", i, 0)] for i in range(warm)]
    owed: list[int] = []  # micro-batches whose W is still to run

    def backward(i: int, keep: int) -> None:
        groups.append([("B", i, 0)])
        owed.append(i)
        if len(owed) > keep:
            groups.append([("W", owed.pop(0), 0)])

    for i in range(m - warm):
        groups.append([("F", warm + i, 0)])
        backward(i, rank)
    for i in range(m - warm, m):
        backward(i, 0 if i < m - 1 else m)
    return groups + [[("W", i, 0)] for i in owed]


class Schedule(list):
    """Per-rank action lists (index = pipeline rank, a list of :class:`Action` each, in execution
    order) and the :class:`~zerotron.stages.Placement` they assume (``.placement``)."""

    def __init__(self, ranks, placement: Placement):
        super().__init__(ranks)
        self.placement = placement


def placement_of(schedule, pp: int, virtual_stages: int = 1) -> Placement:
    """The placement of ``schedule``: its own (a :class:`Schedule`), else the loop of (pp,
    virtual_stages). Raises ValueError when a Schedule's placement disagrees with pp/virtual_stages."""
    place = getattr(schedule, "placement", None)
    if place is None:
        return Placement(pp, virtual_stages)
    if (place.pp, place.v) != (pp, virtual_stages):
        raise ValueError(f"the schedule is for pp={place.pp}, virtual_stages={place.v}; got pp={pp}, "
                         f"virtual_stages={virtual_stages}")
    return place


def _with_comm(groups, rank: int, place: Placement) -> list[Action]:
    """Before each group one comm run: SENDs of the previous group's cross-rank outputs, then
    RECVs of this group's cross-rank inputs (each in compute order); the last group's SENDs
    close the list."""
    last = place.n_stages - 1

    def peer(kind: str, chunk: int, out: bool) -> int | None:
        if kind == "W":  # weight gradients: nothing in, nothing out
            return None
        stage = place.stage_of(rank, chunk)
        other = stage + (1 if (kind == "F") == out else -1)
        if not 0 <= other <= last or place.rank_of(other) == rank:
            return None
        return place.rank_of(other)

    actions: list[Action] = []
    for prev, group in zip([[]] + groups, groups + [[]]):
        for kind, mb, chunk in prev:
            if (q := peer(kind, chunk, True)) is not None:
                actions.append(Action("SEND_" + kind, mb, chunk, q))
        for kind, mb, chunk in group:
            if (q := peer(kind, chunk, False)) is not None:
                actions.append(Action("RECV_" + kind, mb, chunk, q))
        actions += [Action(kind, mb, chunk) for kind, mb, chunk in group]
    return actions


def build_schedule(pp: int, microbatches: int, kind: str,
                   virtual_stages: int = 1) -> Schedule:
    """Per-rank action lists (index = pipeline rank), in execution order, for ``kind`` in
    "naive" | "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-v" (sources in the module docstring),
    as a :class:`Schedule` carrying its placement (zb-v: the V).

    Raises ValueError for pp < 1 or microbatches < 1; "naive" with microbatches != 1; "zb-v" with
    virtual_stages != 2; another kind but "interleaved" with virtual_stages != 1; "interleaved"
    with virtual_stages < 2 or microbatches % pp != 0 (Megatron's requirement); an unknown kind
    (listing the valid ones).
    """
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if kind == "interleaved":
        if virtual_stages < 2:
            raise ValueError(f"interleaved needs virtual_stages >= 2, got {virtual_stages}")
        if microbatches % pp:
            raise ValueError(f"interleaved needs microbatches % pp == 0, got "
                             f"microbatches={microbatches}, pp={pp}")
    elif kind == "zb-v":
        if virtual_stages != 2:
            raise ValueError(f"zb-v places two chunks per rank in a V: virtual_stages must be 2, got {virtual_stages}")
        place = Placement(pp, 2, "v")
        return Schedule(_fifo_receives([_with_comm(g, r, place) for r, g in enumerate(zb_v_groups(pp, microbatches))],
                                       place), place)
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages must be 1 for kind {kind!r} (only 'interleaved' and 'zb-v' use it)")
    if kind == "naive" and microbatches != 1:
        raise ValueError(f"naive runs one batch without micro-batching: microbatches must be 1, "
                         f"got {microbatches} (use 'gpipe' or '1f1b')")
    place = Placement(pp, virtual_stages)
    return Schedule([_with_comm(_compute_groups(pp, microbatches, kind, virtual_stages, r), r, place)
                     for r in range(pp)], place)


def _fifo_receives(schedule: list[list[Action]], place: Placement) -> list[list[Action]]:
    """Move RECVs earlier so each rank receives from each peer in the order the peer sends (FIFO,
    for order-based matching). zb-v needs it: rank 0 -> 1 carries both stage 0's activations and
    stage 2p-1's gradients, whose compute order on rank 1 can differ from their send order. A RECV
    that would come too late is posted right before the first RECV from the same peer that would
    overtake it (same comm run, still before its compute); its message was sent before that one's,
    so nothing waits longer and no deadlock can appear."""
    sent: dict = {}  # (sender, receiver) -> message keys in send order
    for r, acts in enumerate(schedule):
        for a in acts:
            if a.kind.startswith("SEND"):
                sent.setdefault((r, a.peer), []).append(message_key(a, r, place))
    out = []
    for r, acts in enumerate(schedule):
        pending = {q: list(keys) for (q, d), keys in sent.items() if d == r}  # per sender, in send order
        by_key = {message_key(a, r, place): a for a in acts if a.kind.startswith("RECV")}
        posted, new = set(), []
        for a in acts:
            if not a.kind.startswith("RECV"):
                new.append(a)
                continue
            key = message_key(a, r, place)
            if key in posted:
                continue
            queue = pending[a.peer]
            while queue[0] != key:  # earlier-sent messages from this peer first
                earlier = queue.pop(0)
                new.append(by_key[earlier])
                posted.add(earlier)
            queue.pop(0)
            new.append(a)
            posted.add(key)
        out.append(new)
    return out


def message_key(action: Action, rank: int, place: Placement) -> tuple[str, int, int]:
    """Identity of the tensor a SEND/RECV of pipeline ``rank`` carries under placement ``place``:
    (direction "F"/"B", microbatch, producer stage). A SEND and a RECV match iff their keys are
    equal. Raises ValueError for a compute action."""
    if action.kind not in COMM:
        raise ValueError(f"{action.kind!r} is not a communication action")
    direction = action.kind[-1]
    stage = place.stage_of(rank, action.chunk)
    if action.kind.startswith("RECV"):
        stage += -1 if direction == "F" else 1
    return direction, action.microbatch, stage


def check_schedule(schedule: list[list[Action]], pp: int, microbatches: int,
                   virtual_stages: int = 1) -> None:
    """Raise ValueError unless ``schedule`` is well formed: one list per rank; each rank runs F and
    B exactly once per (microbatch, chunk), F first, and at most one W, after that B (a split
    backward); every SEND has exactly one matching RECV on its
    peer (see :func:`message_key`) with the right peer fields; each cross-rank input is received
    before its compute and each output sent after it; messages per ordered rank pair are FIFO."""
    v = virtual_stages
    place = placement_of(schedule, pp, v)
    if len(schedule) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(schedule)}")
    sends: dict = {}
    recvs: dict = {}
    for r, actions in enumerate(schedule):
        seen: set = set()
        for a in actions:
            if a.kind not in COMPUTE + COMM or not 0 <= a.chunk < v:
                raise ValueError(f"rank {r}: bad action {a}")
            if a.kind in COMPUTE:
                if (a.kind, a.microbatch, a.chunk) in seen:
                    raise ValueError(f"rank {r}: duplicate {a}")
                if a.kind == "B" and ("F", a.microbatch, a.chunk) not in seen:
                    raise ValueError(f"rank {r}: {a} before its forward")
                if a.kind == "W" and ("B", a.microbatch, a.chunk) not in seen:
                    raise ValueError(f"rank {r}: {a} before its input-gradient backward B")
                seen.add((a.kind, a.microbatch, a.chunk))
                continue
            key = message_key(a, r, place)
            book = sends if a.kind.startswith("SEND") else recvs
            if key in book:
                raise ValueError(f"rank {r}: duplicate {a}")
            other = key[2] + (1 if key[0] == "F" else -1) if book is sends else key[2]
            if a.peer != place.rank_of(other):
                raise ValueError(f"rank {r}: {a} has the wrong peer (expected {place.rank_of(other)})")
            produced = (key[0], a.microbatch, a.chunk) in seen
            if produced != (book is sends):  # SEND after its compute, RECV before its compute
                raise ValueError(f"rank {r}: {a} is on the wrong side of its compute")
            book[key] = (r, a.peer, len(book))
        want = {(k, i, c) for k in ("F", "B") for i in range(microbatches) for c in range(v)}
        if {x for x in seen if x[0] != "W"} != want:
            raise ValueError(f"rank {r}: computes missing: {sorted(want - seen)[:4]}")
    if set(sends) != set(recvs):
        raise ValueError(f"unmatched SEND/RECV: {sorted(set(sends) ^ set(recvs))[:4]}")
    for src, dst in {(s, d) for s, d, _ in sends.values()}:
        out = sorted((n, k) for k, (s, d, n) in sends.items() if (s, d) == (src, dst))
        inn = sorted((n, k) for k, (d, s, n) in recvs.items() if (s, d) == (src, dst))
        if [k for _, k in out] != [k for _, k in inn]:
            raise ValueError(f"messages {src}->{dst} are received in a different order than sent")
