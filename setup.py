"""spmdtask: SPMD training on JAX (pjit + shard_map pipelines)."""
import setuptools

setuptools.setup(
    name="spmdtask",
    version="0.1.0",
    description="Train JAX/Flax models with SPMD parallelism: split-dims mappings, "
    "a pure partitioner, pipelines over a stage mesh axis.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["spmdtask", "spmdtask.*", "configs"]),
    install_requires=[
        "jax[cpu]>=0.10.2,<0.11",
        "jaxlib>=0.10.2,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12,<0.13",
        "fiddle>=0.3.1,<0.4",
        "absl-py>=2.1,<3",
        "tensorflow-cpu>=2.21,<2.22",
        "tensorboard>=2.21,<2.22",
        "numpy>=1.26",
        "sentencepiece>=0.2,<0.3",
        "safetensors>=0.4.3,<0.9",
        "ml-dtypes>=0.5",
        "tokenizers>=0.15",  # an imported model's tokenizer.json (hf:PATH)
        "jinja2>=3.1.6",  # chat templates (inputs/chat_template.py); transformers' minimum
        # Users' records (inputs/records.py): Parquet files and datasets saved to disk.
        "pyarrow>=15",
        "datasets>=3,<6",
        # gs:// job and data dirs (spmdtask/fs.py); google-cloud-storage: its start-up probe.
        "fsspec>=2024.6",
        "gcsfs>=2024.6",
        "google-cloud-storage>=2.14",
        # int8 / fp8 projections (spmdtask/layers/quant.py): its quantizer, private helpers
        # pinned by the range.
        "qwix>=0.1.8,<0.2",
        # --mode=lm_eval (run/lm_eval_backend.py): its core, no torch (torch is its hf extra).
        "lm-eval==0.4.13",
    ],
    extras_require={
        # XLA:TPU (libtpu): train on Cloud TPU, and --mode=plan --plan_topology=v5e:16x16
        # compiles for a TPU topology on any machine.
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
        # Train on NVIDIA GPUs: jaxlib's CUDA 12 plugin with the CUDA libraries as wheels.
        "gpu": ["jax[cuda12]>=0.10.2,<0.11"],
        # XLA:GPU for --plan_topology=h100:8 on any machine: the CUDA plugin and cuDNN (what
        # the fused attention compiles against), none of the other CUDA libraries.
        "gpu_plan": ["jax-cuda12-plugin>=0.10.2,<0.11", "nvidia-cudnn-cu12>=9.8,<10"],
        # The tests plan TPU topologies too, and run a job in a local GCS emulator.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "jax[tpu]>=0.10.2,<0.11",
                 "gcp-storage-emulator>=2024.8"],
        # The docs site (mkdocs.yml, docs/): `mkdocs build --strict`, as .ci/run does.
        "docs": ["mkdocs>=1.6.1,<1.7", "mkdocs-material>=9.8,<9.9"],
    },
)
