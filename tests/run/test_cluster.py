"""Joining a job: which cluster JAX's own detection sees, and the mistakes (exit-2 errors)."""
import pytest

from spmdtask.run import cluster
from spmdtask.errors import ConfigError
from tools import launch_local

CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST",
                "TPU_WORKER_HOSTNAMES")


@pytest.fixture()
def plain(monkeypatch):
  for var in CLUSTER_VARS:
    monkeypatch.delenv(var, raising=False)
  return monkeypatch


def test_plain_machine_is_one_process(plain):
  assert cluster.detected_env() is None
  assert cluster.join(None, None, None, "auto") is None
  assert cluster.join(None, None, None, "false") is None


def test_srun_environment_is_jax_slurm_cluster(plain):
  for key, value in launch_local.slurm_env(2, 1, job_id=4096 + 17).items():
    plain.setenv(key, value)
  env = cluster.detected_env()
  assert env.name == "slurm"
  # JAX's own reading of it: coordinator on the first node, port 61440 + job id % 4096.
  assert env.get_coordinator_address(None, None) == "127.0.0.1:61457"
  assert (env.get_process_count(), env.get_process_id()) == (2, 1)


@pytest.mark.parametrize("args,message", [
    ((None, None, None, "true"), "--multihost=true, but this process runs in no cluster"),
    (("127.0.0.1:1234", 2, None, "auto"), "--coordinator_address needs --num_processes"),
    ((None, None, None, "maybe"), "--multihost='maybe'"),
    # What jax.distributed.initialize would reject (a ValueError, an IndexError), or ignore.
    (("127.0.0.1:1234", 2, 5, "auto"), "--process_id=5 is not an index of --num_processes=2"),
    (("127.0.0.1:1234", 2, -1, "auto"), "--process_id=-1 is not an index"),
    (("127.0.0.1:1234", 0, 0, "auto"), "--num_processes=0: give the job's process count"),
    (("127.0.0.1", 2, 0, "auto"), "--coordinator_address='127.0.0.1' is not host:port"),
    (("host:http", 2, 0, "auto"), "--coordinator_address='host:http' is not host:port"),
    (("[::1]:65536", 2, 0, "auto"), "is not host:port"),
    ((None, 2, 1, "auto"), "--num_processes and --process_id need --coordinator_address"),
])
def test_mistakes_are_config_errors(plain, args, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    cluster.join(*args)
