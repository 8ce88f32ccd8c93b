"""The libtpu flags tuned experiments carry in `task.xla_flags` (set before JAX starts, in
the run and in the plan alike): MaxText's, for the configs compare_maxtext sets side by side."""

# libtpu flags of MaxText's v6e tuning config for Llama 3.1 8B (benchmarks/
# maxtext_trillium_model_configs.py `llama3_1_8b_8192`, from its xla_flags_library): the
# numbers compare_maxtext shows for `Llama31_8B_V6e256` are compiled under them.
V6E_FLAGS = (
    "--xla_tpu_scoped_vmem_limit_kib=98304 "
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
    "--xla_tpu_assign_all_reduce_scatter_layout=true "
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
    "--xla_tpu_enable_all_reduce_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=true "
    "--xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false "
    "--xla_sc_disable_megacore_partitioning=true "
    "--xla_tpu_enable_all_experimental_scheduler_features=true "
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true "
    "--xla_tpu_host_transfer_overlap_limit=24 --xla_tpu_aggressive_opt_barrier_removal=ENABLED "
    "--xla_lhs_prioritize_async_depth_over_stall=ENABLED "
    "--xla_tpu_enable_ag_backward_pipelining=true "
    "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED "
    "--xla_max_concurrent_host_send_recv=100 "
    "--xla_tpu_scheduler_percent_shared_memory_limit=100 "
    "--xla_latency_hiding_scheduler_rerun=2")

# libtpu flags of MaxText's v5p config for Llama 2 70B (benchmarks/maxtext_v5p_model_configs.py
# `llama2_70b_v5p_128`): data-parallel all-reduce overlap, all-gathers in collective fusions.
V5P_FLAGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true")
