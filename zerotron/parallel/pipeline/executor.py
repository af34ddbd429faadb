"""Pipeline execution: the stage partition, a rank's stage model, the walker of its action list.

``stage_layer_counts`` splits ``n_layer`` over the pp*v model stages (balanced or ``pp_split``);
it and ``stage_layer_ranges`` live in ``zerotron.stages`` (pure arithmetic) and are re-exported here.

``StageModel`` keeps this rank's part of a model under the ORIGINAL fully-qualified names (blocks
in an ``nn.ModuleDict`` keyed by the global layer index), so ``torch.distributed.checkpoint`` state
dicts are independent of the pipeline layout; what each stage holds comes from ``model.layout()``.

``PipelineExecutor.run`` walks one rank's actions (``parallel.pipeline.schedules.Action``) as the schedules
module docstring prescribes; every maximal run of consecutive SEND/RECV actions goes to
``pipeline.p2p.CommRunPoster``, which on gloo posts the run's sends and receives one by one plus
the NEXT run's receives (early receives: the data arrives while this rank computes), and on other
backends posts the run as ONE ``comm.batch_isend_irecv``. Activation shapes are known
ahead, (b, T, C) of the micro-batch ((b, T/tp, C) with sequence parallelism), so there are no shape
handshakes. A comm run's RECVs are waited for before the next compute, its SENDs only at the
end of the walk (they complete in the background; zero-bubble schedules rely on it). Backward of a
stage is ``torch.autograd.backward(output, grad_of_output)``; the input's ``.grad`` goes upstream;
a micro-batch's saved activations are dropped right after its backward. When the action list has a
W for the (micro-batch, chunk), the backward is split (``pipeline.split_backward``): B computes
only the input gradient and sends it, W later accumulates the weight gradients. Neighbouring stages
on the same rank (pp == 1 interleaving; zb-v's turn p-1 -> p on the last rank) hand tensors over
locally (the schedule has no SEND/RECV for them).

Sources: GPipe (Huang et al. 2019); PipeDream-Flush / 1F1B and the Megatron-LM interleaved schedule
(Narayanan et al. 2021).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from zerotron.models.layout import get_module
from zerotron.parallel.pipeline.p2p import CommRunPoster
from zerotron.parallel.pipeline.schedules import COMM, Action
from zerotron.parallel.pipeline.split_backward import backward_input, backward_weight
from zerotron.stages import Placement, stage_layer_counts, stage_layer_ranges


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root``, creating empty containers on the way."""
    parts = path.split(".")
    for part in parts[:-1]:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(parts[-1], module)


__all__ = ["stage_layer_counts", "stage_layer_ranges", "StageModel", "forward_only_actions", "PipelineExecutor"]


class StageModel(nn.Module):
    """The modules of the model stages ``stages`` (one per local chunk, in chunk order) of ``model``
    (any ``zerotron.models.base.CausalLM``; what goes where comes from ``model.layout()``).

    ``layer_ranges[s]`` is the range of global block indices of model stage s; ``n_stages`` = pp*v.
    Model stage 0 holds the layout's ``embedding`` modules, the last one its ``head`` modules. The
    modules keep their ORIGINAL fully-qualified names (blocks in an ``nn.ModuleDict`` keyed by the
    global index at the layout's ``blocks`` path), so state-dict and optimizer-state keys, and
    ``torch.distributed.checkpoint`` files, are independent of the pipeline layout. They are the
    modules of ``model`` itself (shared Parameters; no copies, no RNG use). A tied head on a rank
    that does not hold stage 0 brings the owner's module along (e.g. the token embedding under its
    dense name), so the tied weight is registered exactly like in the dense model.

    Stage 0 runs ``model.embed`` and the last stage ``model.head`` (bound methods of the dense
    model, whose modules these are); tensor-parallel modules run as they are (the last stage's
    logits are then vocab shards (b, T, V_pad/tp)). ``tp_group`` (None without TP),
    ``sequence_parallel`` and ``config`` mirror the model's, and ``layout()`` is the model's, so
    ``tensor.transform.tp_loss_sum`` / ``tp_state_dict_full`` accept a StageModel."""

    def __init__(self, model: nn.Module, stages: list[int], layer_ranges: list[range]):
        super().__init__()
        self.config = model.config
        self._layout = lay = model.layout()
        object.__setattr__(self, "_dense", model)  # not a submodule: only its embed/head methods
        self.tp_group = getattr(model, "tp_group", None)
        self.sequence_parallel = bool(getattr(model, "sequence_parallel", False))
        self.stages, self.layer_ranges = list(stages), list(layer_ranges)
        self.last_stage = len(layer_ranges) - 1
        paths = list(lay.embedding) if 0 in self.stages else []
        if self.last_stage in self.stages:
            paths += list(lay.head)
            if 0 not in self.stages:  # owners of tied parameters live with stage 0: bring them along
                paths += [owner.rpartition(".")[0] for _, owner in lay.tied]
        blocks = get_module(model, lay.blocks)
        here = {lay.blocks: nn.ModuleDict({str(i): blocks[i] for s in self.stages for i in self.layer_ranges[s]})}
        here.update({p: get_module(model, p) for p in paths})
        for name, _ in model.named_modules():  # registered in the dense model's order
            if name in here:
                _place(self, name, here.pop(name))

    @property
    def blocks_here(self) -> nn.ModuleDict:
        """This rank's blocks, keyed by the global block index (str)."""
        return get_module(self, self._layout.blocks)

    def layout(self):
        """The dense model's :class:`~zerotron.models.layout.ModelLayout` (same FQNs)."""
        return self._layout

    def holds(self, stage: int) -> bool:
        return stage in self.stages

    def run_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Forward of local chunk ``chunk``: tokens (b, T) int64 for model stage 0, else activations
        (b, T, C); returns logits (b, T, V) on the last model stage, else activations (b, T, C)."""
        s = self.stages[chunk]
        if s == 0:
            x = self._dense.embed(x)  # under SP: this rank's sequence shard and its positions
        for i in self.layer_ranges[s]:
            x = self.blocks_here[str(i)](x)
        if s == self.last_stage:
            x = self._dense.head(x)
        return x

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V), only when this rank holds every stage (pp == 1).
        Raises RuntimeError otherwise (drive a pipeline through PipelineStrategy)."""
        if sorted(self.stages) != list(range(self.last_stage + 1)):
            raise RuntimeError("this rank holds only some pipeline stages; use PipelineStrategy."
                               "forward_backward / eval_loss_sum / pipeline_generate")
        x = idx
        for c in sorted(range(len(self.stages)), key=lambda c: self.stages[c]):
            x = self.run_chunk(c, x)
        return x


def forward_only_actions(place: Placement, rank: int) -> list[Action]:
    """Forward-only action list of one batch (eval, generation) of pipeline ``rank`` under
    placement ``place``: per local chunk in stage order, RECV_F (if the stage's input comes from
    another rank), F, SEND_F (if the output goes to another rank). A chain through the stages, so
    the executor's one-batch-per-comm-run rule cannot deadlock."""
    last, acts = place.n_stages - 1, []
    for c in sorted(range(place.v), key=lambda c: place.stage_of(rank, c)):
        s = place.stage_of(rank, c)
        if s > 0 and (q := place.rank_of(s - 1)) != rank:
            acts.append(Action("RECV_F", 0, c, q))
        acts.append(Action("F", 0, c))
        if s < last and (q := place.rank_of(s + 1)) != rank:
            acts.append(Action("SEND_F", 0, c, q))
    return acts


class PipelineExecutor:
    """Runs action lists of pipeline ``rank`` under placement ``place``. ``peer_rank(pp_index) ->
    global rank`` maps a pipeline peer to the global rank at this rank's other coordinates
    (``Mesh.peer(pp=q)``); ``group``: the pp ``comm.NamedGroup``.
    ``busy_s``/``idle_s`` accumulate compute time and time spent posting+waiting comm runs (split
    in ``p2p.post_s``, ``p2p.recv_wait_s``, ``p2p.send_wait_s``; ``p2p.events`` has per-message
    timestamps), ``other_s`` the rest of the walks' wall time (the executor's own bookkeeping);
    ``walk_start_s``/``walk_end_s`` the ``time.perf_counter()`` at the first walk's start and the
    last walk's end since ``reset_timing``; ``compute_s[(kind, chunk)]`` / ``compute_n[(kind,
    chunk)]`` the seconds and count of each compute kind ("F", "B", ...) per local chunk
    (per-stage F/B times for the bubble accounting). All in seconds. ``forward_chunk(chunk, x)``
    runs one chunk's forward: ``stage.run_chunk`` unless a gradient synchroniser routes it through
    its wrapper (FSDP2's root, ``pipeline.stage_sync``)."""

    def __init__(self, stage: StageModel, group, place: Placement, rank: int, peer_rank, act_dtype: torch.dtype):
        self.stage, self.group, self.pp, self.rank = stage, group, place.pp, rank
        self.peer_rank, self.act_dtype = peer_rank, act_dtype
        self.n_embd = stage.layout().width
        self.p2p = CommRunPoster(group, peer_rank, rank, place)
        self.forward_chunk = stage.run_chunk
        self.reset_timing()

    def reset_timing(self) -> None:
        """Zero ``busy_s``, ``idle_s``, ``other_s``, ``compute_s``, ``compute_n`` and the p2p timers
        and events (``self.p2p``); forget ``walk_start_s``/``walk_end_s``."""
        self.busy_s = self.idle_s = self.other_s = 0.0
        self.compute_s, self.compute_n = {}, {}
        self.walk_start_s = self.walk_end_s = None
        self.p2p.reset()

    def run(self, actions: list[Action], tokens: list[torch.Tensor], on_output, autocast,
            b_context=None, w_context=None, documents=None) -> None:
        """Walk ``actions`` over micro-batches ``tokens[i]`` ((b_i, T_i) int64, known on every rank).

        ``on_output(mb, logits)`` is called with the last stage's logits (b, T, V) and returns the
        scalar to back-propagate (or None in forward-only runs). ``autocast()`` gives the context
        of every forward; ``b_context(mb, chunk)`` the context of each backward that produces
        weight gradients (a whole B, or a W; e.g. DDP no_sync); ``w_context(mb, chunk)``, when
        given, replaces it around a W (e.g. ZeRO-3 gathers the blocks first). A split B (input
        gradient only) runs in no context: it accumulates nothing. ``documents(tokens)``, when given
        (``data.doc_mask``), is the context of every F, B and W of that micro-batch (a backward may
        recompute the forward). Raises RuntimeError if a stage
        output has an unexpected shape/dtype or the walk ends with undelivered tensors or pending
        W's (a malformed schedule)."""
        acts_in, grads_in, saved, send_f, send_b, owed = {}, {}, {}, {}, {}, {}
        st = self.stage
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        p2p, dev = self.p2p, tokens[0].device
        p2p.start_walk(actions, lambda a: torch.empty(self._act_shape(tokens[a.microbatch]), dtype=self.act_dtype,
                                                      device=dev))
        t_walk = time.perf_counter()
        if self.walk_start_s is None:
            self.walk_start_s = t_walk
        comm0 = p2p.post_s + p2p.recv_wait_s + p2p.send_wait_s
        busy0 = self.busy_s
        i, n = 0, len(actions)
        while i < n:
            if actions[i].kind in COMM:
                j, out = i, {}
                while j < n and actions[j].kind in COMM:
                    a = actions[j]
                    if a.kind in ("SEND_F", "SEND_B"):
                        out[j] = (send_f if a.kind == "SEND_F" else send_b).pop((a.microbatch, a.chunk))
                    j += 1
                for k, buf in p2p.run(i, out).items():
                    a = actions[k]
                    (acts_in if a.kind == "RECV_F" else grads_in)[(a.microbatch, a.chunk)] = buf
                i = j
                continue
            a = actions[i]
            key, s = (a.microbatch, a.chunk), st.stages[a.chunk]
            t0 = time.perf_counter()
            with documents(tokens[a.microbatch]) if documents else contextlib.nullcontext():
                self._compute(a, key, s, tokens, on_output, autocast, b_context, w_context, split,
                              (acts_in, grads_in, saved, send_f, send_b, owed))
            t1 = time.perf_counter()
            dt, k = t1 - t0, (a.kind, a.chunk)
            p2p.events.append(("C", p2p.walks, (a.kind, a.microbatch, s), t0, t1))
            self.busy_s += dt
            self.compute_s[k] = self.compute_s.get(k, 0.0) + dt
            self.compute_n[k] = self.compute_n.get(k, 0) + 1
            i += 1
        p2p.finish_walk()
        t_end = time.perf_counter()
        comm_s = p2p.post_s + p2p.recv_wait_s + p2p.send_wait_s - comm0
        self.idle_s += comm_s
        self.other_s += (t_end - t_walk) - comm_s - (self.busy_s - busy0)
        self.walk_end_s = t_end
        if acts_in or grads_in or send_f or send_b or owed or (saved and any(a.kind == "B" for a in actions)):
            raise RuntimeError("pipeline walk ended with undelivered tensors: malformed schedule")

    def _compute(self, a: Action, key, s: int, tokens, on_output, autocast, b_context, w_context, split, state) -> None:
        """One F, B or W action of :meth:`run` (``state``: its dicts of tensors in flight)."""
        acts_in, grads_in, saved, send_f, send_b, owed = state
        st, last = self.stage, self.stage.last_stage
        if a.kind == "F":
            inp = None
            if s > 0:
                inp = acts_in.pop(key)
                if torch.is_grad_enabled():
                    inp.requires_grad_()
            with autocast():
                out = self.forward_chunk(a.chunk, tokens[a.microbatch] if s == 0 else inp)
            if s == last:
                out = on_output(a.microbatch, out)
            else:
                self._check(out, tokens[a.microbatch])
                if st.holds(s + 1):  # local hand-off to the chunk of stage s + 1
                    acts_in[(a.microbatch, st.stages.index(s + 1))] = out.detach()
                else:
                    send_f[key] = out.detach()
            if torch.is_grad_enabled() and out is not None:
                saved[key] = (inp, out)
        elif a.kind == "B":
            inp, out = saved.pop(key)
            grad = None if s == last else grads_in.pop(key)
            if key in split:  # input gradient now, weight gradients at this key's W
                dinp, owed[key] = backward_input(out, grad, inp)
            else:
                with b_context(*key) if b_context else contextlib.nullcontext():
                    torch.autograd.backward(out, grad)
                dinp = inp.grad if s > 0 else None
            if s > 0:
                if st.holds(s - 1):
                    grads_in[(a.microbatch, st.stages.index(s - 1))] = dinp
                else:
                    send_b[key] = dinp
            del inp, out, grad, dinp  # free this micro-batch's activations now (split: after W)
        else:  # "W"
            ctx = w_context or b_context
            with ctx(*key) if ctx else contextlib.nullcontext():
                backward_weight(owed.pop(key))

    def _act_shape(self, tok: torch.Tensor) -> tuple:
        """Stage-boundary activation of micro-batch ``tok`` (b, T): (b, T, C), or this rank's
        sequence shard (b, T/tp, C) with sequence parallelism."""
        b, T = tok.shape
        if self.stage.sequence_parallel:
            T //= self.stage.tp_group.size()
        return (b, T, self.n_embd)

    def _check(self, out: torch.Tensor, tok: torch.Tensor) -> None:
        want = self._act_shape(tok)
        if tuple(out.shape) != want or out.dtype != self.act_dtype:
            raise RuntimeError(f"stage output {tuple(out.shape)} {out.dtype} differs from the "
                               f"pre-agreed activation {want} {self.act_dtype}")
