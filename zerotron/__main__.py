"""``python -m zerotron`` == the ``zerotron`` command."""
import gc
import sys

from .cli import main

code = main()
if getattr(sys.modules.get("zerotron.launch"), "launched", False):
    # a launcher whose workers have ended: its interpreter's last collections would scan every object
    # of torch and of the stack it preloaded for forked workers (~0.8 CPU s; 10-14 s of wall at a load
    # average of ~20, which held up `serve --nproc`'s exit after a SIGTERM); freeze them instead
    gc.freeze()
sys.exit(code)
