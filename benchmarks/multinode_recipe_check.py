"""Run README's multi-node recipe as written on the two-node harness (root): ``plain`` (the torchrun
block, with eth0 -> the node's veth, 10.0.0.1 -> node 0, 8 -> 2 workers, the tiny config) or
``slurm`` (the command each srun task runs, with SLURM_* set as Slurm would). Exit 0 when both nodes
finish. Usage: ``python benchmarks/multinode_recipe_check.py plain|slurm``."""
import os
import re
import subprocess
import sys
import tempfile

from zerotron.testing_netns import TwoNodes

text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
blocks = re.findall(r"```bash\n(.*?)```", text[text.index("### Many nodes"):], re.S)
which = sys.argv[1]
CACHE = os.environ.get("ZEROTRON_CACHE", tempfile.mkdtemp())
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
tail = "-m zerotron train --config configs/tiny.toml --train.steps 3 --train.micro_batch 2 --log.progress false --data.cache_dir " + CACHE + ""
if which == "plain":
    script = blocks[0].replace("IFACE=eth0", "IFACE=$NODE_IF").replace("10.0.0.1", "10.99.0.1").replace("--nproc-per-node 8", "--nproc-per-node 2")
    script = re.sub(r"-m zerotron train .*", tail + " --run-dir " + tempfile.mkdtemp() + "/plain", script)
else:
    inner = re.search(r"srun bash -c '(.*)'", blocks[1], re.S).group(1)
    inner = inner.replace("--nproc-per-node 8", "--nproc-per-node 2")
    inner = re.sub(r"-m zerotron train .*", tail + " --run-dir " + tempfile.mkdtemp() + "/slurm", inner)
    script = inner
print(script)
from zerotron.data import prepare_data  # noqa: E402
from zerotron.testing import tiny_config  # noqa: E402  (build the token cache once, before the workers)

d = tiny_config({"data.cache_dir": CACHE}).data
prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
env = {**os.environ, "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"], "OMP_NUM_THREADS": "1"}
with TwoNodes() as t:
    ps = []
    for n in t.nodes:
        e = {**env, "NODE_IF": n.ifname, "IFACE": n.ifname, **({"GLOO_SOCKET_IFNAME": n.ifname} if which == "slurm" else {}),  # the job's export
             "SLURM_NNODES": "2", "SLURM_NODEID": str(n.index),
             "SLURM_JOB_ID": "77", "HEAD_ADDR": t.nodes[0].ip}
        ps.append(subprocess.Popen(t.exec_argv(n, ["bash", "-c", script]), env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes = []
    for p in ps:
        out, _ = p.communicate(timeout=300)
        codes.append(p.returncode)
        print("rc", p.returncode, "\n".join(l for l in out.splitlines() if "zerotron" in l or "steps" in l)[-800:])
sys.exit(max(codes, key=abs))
