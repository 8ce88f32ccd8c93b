"""What a run reports about its speed: the start summary, throughput and MFU of a stretch of
steps (the loop's progress line and TensorBoard read these)."""
from spmdtask import console, fs
from spmdtask.core import memory, program as program_lib
from spmdtask.plan import chips


def mfu_peak(program: program_lib.Program) -> chips.Peak:  # the mesh's chip, or the override
  return chips.mfu_peak(program.mesh.devices.flat[0].device_kind,
                        program.task.train.peak_flops_per_device)


def rates(program: program_lib.Program, num_steps: int, seconds: float,
          batch_size: int, target_tokens: float | None = None) -> dict[str, float]:
  """Throughput of `num_steps` steps in `seconds`; MFU against `mfu_peak` (every token).
  `target_tokens` (the steps' summed loss weights, where the data has target masks) adds
  target_tokens_per_sec."""
  examples, peak = num_steps * batch_size / seconds, mfu_peak(program).flops_per_s
  out = {"steps_per_sec": num_steps / seconds, "examples_per_sec": examples,
         "tokens_per_sec": examples * program.work.tokens,
         "mfu": examples * program.work.train_flops / (peak * program.mesh.devices.size)}
  if target_tokens is not None:
    out["target_tokens_per_sec"] = target_tokens / seconds
  return out


def start_summary(program: program_lib.Program, name: str, batch_size: int,
                  job_log_dir: str | None) -> list[str]:
  """The lines a run starts with: what trains, on what mesh, its state bytes, where it logs."""
  t = memory.totals(memory.state_rows(program.layout, dict(program.mesh.shape)))
  devices = program.mesh.devices
  lines = [f"{name}: {console.params(t['num_params'], program.work.active_params)} on "
           f"{program_lib.mesh_words(program)} "
           f"({console.count(devices.size, devices.flat[0].platform + ' device')}); train state "
           f"{console.human_bytes(t['state_bytes_per_device'])} per device "
           f"({console.human_bytes(t['state_bytes_total'])} in all); global batch {batch_size} "
           f"({batch_size * program.work.tokens} tokens/step); MFU against "
           f"{mfu_peak(program).figure()} per device ({mfu_peak(program).source})"]
  if job_log_dir is not None:
    lines.append(f"job dir {fs.absolute(job_log_dir)} (config.txt, checkpoints/, "
                 "summaries/, logs/)")
  return lines + program.describe()  # the execution strategy (and its stages)
