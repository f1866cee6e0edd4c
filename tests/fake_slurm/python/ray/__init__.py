"""fake ray for the batch script's driver snippets: the nodes the fake `ray start` calls
registered (tests/fake_slurm/README.md)."""
import os


def init(address=None, **kwargs):
    assert address, "ray.init needs the head's address"


def nodes():
    with open(os.path.join(os.environ["FAKE_SLURM"], "ray-nodes")) as f:
        return [{"NodeName": line.strip(), "Alive": True} for line in f if line.strip()]
