"""Joining a multi-process job before any JAX computation.

Three ways, first match wins:
1. explicit `--coordinator_address/--num_processes/--process_id` (tools/launch_local.py);
2. `--multihost=auto` (the default) or `true`: a cluster that JAX itself recognises (its
   `jax._src.clusters.ClusterEnv` subclasses: Cloud TPU pod VMs and GKE TPU pods, SLURM
   `srun` steps, Open MPI `mpirun`, Kubernetes JobSets) -> `jax.distributed.initialize()`
   with no arguments, so JAX reads the coordinator, process count and index from that
   environment exactly as it documents;
3. none of them: one process, as on a laptop (`--multihost=true` then is a ConfigError).
A joined process watches the others (`peers`): a lost one stops the job within a minute.

The environment is told apart with JAX's own `is_env_present` (never re-parsed here), so a
cluster JAX learns to detect is detected here too.
"""
from spmdtask.errors import ConfigError

MODES = ("auto", "true", "false")
# JAX's own lost-process detection (a fatal abort) stays behind spmdtask's (`peers.LOST_S`,
# 30 s), as a backstop: it fires between about half this and this long after a loss
# (measured with 50: 28.8 s, before spmdtask's verdict), so 100 s (JAX's default).
JAX_HEARTBEAT_S = 100


def describe(how: str) -> str:
  """The console line for a process that joined through `how` (call after backends start)."""
  import jax  # pylint: disable=g-import-not-at-top
  return (f"Joined a {jax.process_count()}-process job ({how}) as process "
          f"{jax.process_index()}.")


def detected_env():
  """The JAX ClusterEnv class this process runs under (JAX's own detection order), or None.

  Opt-in methods (mpi4py) are skipped, as `jax.distributed.initialize()` skips them.
  """
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  return next((env for env in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
               if not env.opt_in_only_method and env.is_env_present()), None)


def join(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
         multihost: str = "auto") -> str | None:
  """Initialises jax.distributed when the flags or the environment ask for it.

  Returns how it joined ('flags' or JAX's name of the cluster: 'slurm', 'gcetpu', ...), or
  None for a single process. Must run before JAX's backends start; starts none itself.
  """
  if multihost not in MODES:
    raise ConfigError(f"--multihost={multihost!r}: give one of {', '.join(MODES)}.")
  check_flags(coordinator_address, num_processes, process_id)
  import jax  # pylint: disable=g-import-not-at-top
  if coordinator_address:
    _cpu_collectives(jax)
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=JAX_HEARTBEAT_S)
    return "flags"
  if multihost == "false":
    return None
  env = detected_env()
  if env is None:
    if multihost == "true":
      raise ConfigError(
          "--multihost=true, but this process runs in no cluster JAX recognises (Cloud TPU "
          "pod VM, GKE TPU, SLURM srun step, Open MPI mpirun, Kubernetes JobSet). Start it "
          "through one of them (tools/launch_pod.py prints the commands), pass "
          "--coordinator_address/--num_processes/--process_id, or drop --multihost.")
    return None
  _cpu_collectives(jax)
  # Naming the detected method makes JAX use exactly that environment.
  jax.distributed.initialize(cluster_detection_method=getattr(env, "name", "") or None,
                             heartbeat_timeout_seconds=JAX_HEARTBEAT_S)
  return getattr(env, "name", "") or env.__name__


def check_flags(coordinator_address: str | None, num_processes: int | None,
                process_id: int | None) -> None:
  """ConfigError for cluster flags that `jax.distributed.initialize` would reject (with a
  ValueError, or an IndexError on an address without a port) or that would be ignored."""
  if not coordinator_address:
    if num_processes is not None or process_id is not None:
      raise ConfigError(
          "--num_processes and --process_id need --coordinator_address (host:port of process "
          "0); without it they would be ignored. Give all three, e.g. "
          "--coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0, or none.")
    return
  if num_processes is None or process_id is None:
    raise ConfigError("--coordinator_address needs --num_processes and --process_id (this "
                      "process's index, 0-based), the same on every process but the index.")
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(
        f"--coordinator_address={coordinator_address!r} is not host:port (a port from 1 to "
        "65535), e.g. --coordinator_address=10.0.0.1:1234 or [::1]:1234: process 0's address "
        "and a free port on it, the same on every process.")
  if num_processes < 1:
    raise ConfigError(f"--num_processes={num_processes}: give the job's process count, 1 or "
                      "more, the same on every process.")
  if not 0 <= process_id < num_processes:
    raise ConfigError(
        f"--process_id={process_id} is not an index of --num_processes={num_processes}: give "
        f"each process its own index from 0 to {num_processes - 1} (0 on the coordinator's "
        "host).")


def _cpu_collectives(jax) -> None:
  # CPU processes talk over gloo; accelerators keep their own collectives (this flag only
  # affects the CPU backend).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")


def kv_store():
  """JAX's distributed key-value store client of this process (None until joined): the
  job lock's outcome and the peers' beats go through it."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client
