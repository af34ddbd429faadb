"""Does reading the KV pool in place pay inside the compiled paged decode on CPU? (issue 31, eighth session)

Historical: it patches ``paged_compiled._PoolReadView``, the slot-level gather that session 10
replaced by a per-block in-place read (``paged_compiled.paged_decode_attention``, which pays:
``benchmarks/serve_step_breakdown.md``); run it on a tree at 753652c or earlier.

Usage: ``PYTHONPATH=. python benchmarks/serve_inplace_attention.py --checkpoint RUN --variant V [--rows 16]
[--rounds 4] [--json F]``, one variant per process (each is its own Inductor graph: set
``TORCHINDUCTOR_CACHE_DIR`` to a directory of its own to time a cold compile).

``zerotron.inference.paged_compiled`` appends each row's new key and value to its cached context (a
concatenation), so Inductor copies every layer's context out of the pool once per step before its
reductions read it. The variants, patched in here (the same graph otherwise):

* ``copy``: the shipped code (context + new column concatenated: keys and values copied);
* ``inplace``: the context and the new column kept apart, the softmax over the two parts merged by
  their common maximum (log-sum-exp, Milakov & Gimelshein 2018), so no concatenation: the scores'
  loop reads the keys straight from the pool (vectorised over D), the values' weighted sum reads the
  pool in place too;
* ``inplace-mm``: as ``inplace``, the values' weighted sum a matrix product (an extern bmm, its
  operand materialised);
* ``keys-inplace``: keys read in place, values concatenated (copied) as in ``copy``.

Each round runs the engine alone (``benchmarks/serve_engine_profile.py``'s workload: B random rows
decoded together, greedy, 128 new tokens) with the patched compiled decode and eagerly, back to back
in alternating order, checks the tokens equal, and prints the paired ratio of thread CPU per step
(compiled ÷ eager). The generated C++ can be read with ``TORCH_LOGS=output_code``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_engine_profile as sep  # noqa: E402

from zerotron.inference import paged_compiled as pc  # noqa: E402


def _split_attention(values: str):
    def attention(q, k, v, pad, k_new, v_new):
        B, H, _, D = q.shape
        hkv, S = k.size(1), k.size(2)
        qg = q.reshape(B, hkv, H // hkv, 1, D) * (1.0 / math.sqrt(D))
        s = (qg * k[:, :, None]).sum(-1)  # (B, H_kv, rep, S): the cached context only
        masked = torch.arange(S, device=q.device)[None, :] < pad[:, None]
        s = s.masked_fill(masked[:, None, None, :], float("-inf"))
        s_new = (qg * k_new[:, :, None]).sum(-1)  # (B, H_kv, rep, 1): the own key, never masked
        m = torch.maximum(s.amax(-1, keepdim=True), s_new)
        e, e_new = torch.exp(s - m), torch.exp(s_new - m)
        if values == "inplace":
            num = (e[..., None] * v[:, :, None]).sum(-2) + e_new * v_new[:, :, None, 0]
        elif values == "mm":
            num = torch.matmul(e, v) + e_new * v_new[:, :, None, 0]
        else:  # "copy": the values concatenated with the own one
            w = torch.cat([e, e_new], dim=-1)
            num = (w[..., None] * torch.cat([v, v_new], dim=2)[:, :, None]).sum(-2)
        return (num / (e.sum(-1, keepdim=True) + e_new)).reshape(B, H, 1, D)
    return attention


def patch(variant: str) -> None:
    """Install ``variant``'s attention into ``paged_compiled`` (before the first compile)."""
    if variant == "copy":
        return
    attn = _split_attention({"inplace": "inplace", "inplace-mm": "mm", "keys-inplace": "copy"}[variant])

    def update(self, layer, k, v):
        B, S1 = self.old.shape
        self.new_k.append(k)
        self.new_v.append(v)
        out = []
        for pool, new in ((self.keys[layer], k), (self.values[layer], v)):
            out.append((pool[:, self.old.reshape(-1)].reshape(pool.size(0), B, S1, pool.size(2)).transpose(0, 1),
                        new))
        return out[0], out[1]

    def hook(self, q, k, v, dropout_p, pad=None):
        (k, k_new), (v, v_new) = k, v
        return attn(q, k, v, pad, k_new, v_new).to(q.dtype)

    pc._PoolReadView.update = update
    pc._DecodeHooks.attention = hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--variant", required=True, choices=("copy", "inplace", "inplace-mm", "keys-inplace"))
    ap.add_argument("--rows", default="16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    patch(args.variant)
    sys.argv = [sys.argv[0], "--checkpoint", args.checkpoint, "--rows", args.rows, "--workloads", "random",
                "--rounds", str(args.rounds), "--compile", "on,off", *(["--json", args.json] if args.json else [])]
    sep.main()
    if args.json:
        rows = json.loads(Path(args.json).read_text())
        Path(args.json).write_text(json.dumps([{"variant": args.variant, **r} for r in rows], indent=1))


if __name__ == "__main__":
    main()
