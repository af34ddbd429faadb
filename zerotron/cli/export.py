"""``zerotron export``: a checkpoint of any layout as a Hugging Face directory."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_help import HelpFormatter, OneLineErrorParser
from .errors import fail, user_errors


def export_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron export``."""
    p = OneLineErrorParser(prog="zerotron export", formatter_class=HelpFormatter, description="Export a "
                                "checkpoint of any layout as a Hugging Face directory (config.json + "
                                "model.safetensors): GPT2LMHeadModel or LlamaForCausalLM, by the model's family.")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    return p


def cmd_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    try:
        import torch

        from ..data.tokenizer import read_special_tokens, write_special_files
        from ..distributed import mesh
        from ..generate import load_model
        from ..models.registry import export_hf

        owned = not torch.distributed.is_initialized()
        mesh.init_distributed(timeout_s=600, device=torch.device("cpu"))
        from ..generate import resolve_checkpoint

        model, tok, _ = load_model(args.checkpoint, torch.device("cpu"))
        specials = read_special_tokens(resolve_checkpoint(args.checkpoint), tok)  # the checkpoint's own
        out = export_hf(model, args.out, overwrite=args.overwrite, eos_token_id=specials.eos_id)
        tok.save(str(Path(out) / "tokenizer.json"))
        write_special_files(out, specials)  # bos/eos/pad ids (every stop id) and the chat template
        if owned:
            mesh.teardown()
        files = ", ".join(sorted(p.name for p in Path(out).iterdir() if p.is_file()))
        print(f"wrote {out}: {files} (transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
              f"PreTrainedTokenizerFast(tokenizer_file={str(Path(out) / 'tokenizer.json')!r}))")
        return 0
    except user_errors() as e:
        return fail(str(e))
    except ValueError as e:
        return fail(str(e))
