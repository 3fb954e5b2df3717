"""The test tiers, in one place (besides the ``bridge`` tier: the modules of tests/bridge/, marked
``bridge`` and ``slow`` in them, out of the README's suite and the fast tier, run in their own
environment by ``.ci/run``: ``.venv-bridge/bin/python -m pytest -q -m bridge tests/bridge``; 20
tests, 1:40 on the 2-core machine beside other work, plus 1:44 to build
the environment, launch/envs/bridge.sh): what ``pytest -m "not slow"`` (the fast tier, under 5 minutes on
the 2-core machine) leaves out besides the modules marked ``slow`` themselves.

:data:`SLOW` was measured (``MGSPO_TEST_TIMES=FILE pytest -q``: tests/conftest.py logs every test's
time): every test above 3 s on the 2-core machine under load, and every end-to-end test (they
share a session SFT policy of ~90 s), except one representative of each area that keeps every
module in the fast tier: one training layout (TP2xEP2), one GSPO gradient layout (EP2), exact
checkpoint resume, vocab-parallel log-probs, routing replay (EP2), packed context parallelism
(CP2), the RL trainer (TP2), SGLang's own weight-update code, the real router, the RL session and
the memory planner's parameter count. The README's test command runs everything.

Entries are node-id prefixes: a file, a test function (all its parameters) or one parametrised
case. tests/conftest.py marks them ``slow`` at collection, and also every test of the tiers out of
the README's suite (``extended``, ``bridge``, ``vllm``): ``-m "not slow"`` replaces
pyproject.toml's ``-m``, so without it the fast tier ran them (22 tests, ~2.5 min, with the
vLLM environment built).

:data:`EXTENDED` (marked ``extended`` at collection, like the tests marked so in their modules):
the longest end-to-end checks, out of the README's suite (which must stay under 20 minutes on
the 2-core machine) and run by ``.ci/run`` after it, ``pytest -m extended``. Measured with
``MGSPO_TEST_TIMES`` on 2026-12-04: each above ~25 s; since 2026-12-07 also layout cases whose
area keeps other cases in the suite.

The ``vllm`` tier (marked in its modules, tests/engines): the pipeline against real vLLM 0.32 from
its own environment (launch/envs/vllm_cpu.sh), out of the README's suite (pyproject.toml's
addopts) and run by ``.ci/run`` last, ``pytest -m vllm`` (docs/vllm.md).
"""

SLOW = (
    # moved out of the fast tier on 2026-12-07, evening (it measured 5:05 after issues 35-37's
    # merges, quiet 2-core machine; seconds each, MGSPO_TEST_TIMES): they stay in the README's suite
    "tests/e2e/test_rl_session.py::test_a_failing_step_releases_the_servers_router_groups_and_signals",  # 9.8
    "tests/reliability/test_client_file_descriptors.py::test_bounded_connections_and_emfile_named_as_such",  # 3.5
    "tests/reliability/test_fault_phases.py::test_the_fault_fires_at_its_phase_and_step_on_its_rank",  # 3.4
    "tests/unit/test_trackers.py::test_wandb_and_mlflow_equal_metrics_jsonl_across_a_crash_and_resume",  # 3.3
    "tests/reliability/test_producer_process.py::test_an_error_in_the_producer_reaches_rank0_as_itself_naming_the_server",  # 2.7
    "tests/reliability/test_producer_process.py::test_the_producers_death_while_rank0_waits_is_one_line_not_a_hang",  # 2.3
    "tests/distributed/test_attention_cp.py",
    "tests/distributed/test_context_parallel.py::test_sequence_all_reduce_forward_sum_backward_identity",
    "tests/distributed/test_convert.py",
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[DP2]",
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[DP2xPP2]",
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[PP2]",
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[TP2]",
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[TP2xEP2]",
    "tests/distributed/test_gspo_layouts.py::test_reference_exercises_clipping_and_padding",
    "tests/distributed/test_hf_export.py",
    "tests/distributed/test_init_from.py",
    "tests/distributed/test_kl_reference.py",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[DP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[EP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[PP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[PP2xTP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[TP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[TP2xEP2xETP2]",
    "tests/distributed/test_layouts.py::test_tied_embeddings_under_pipeline_parallelism",
    "tests/distributed/test_lr_schedule.py::test_lr_follows_warmup_and_decay_and_resumes_exactly",
    "tests/distributed/test_memory_layouts.py::test_recompute_single_process_matches_no_recompute[full_uniform_1]",
    "tests/distributed/test_memory_layouts.py::test_recompute_under_pipeline_and_data_parallel_layouts",
    "tests/distributed/test_memory_layouts.py::test_tensor_and_expert_parallel_with_recompute",
    "tests/distributed/test_memory_layouts.py::test_uneven_pipeline_stages_match_single_process",
    "tests/distributed/test_nccl_semantics.py",
    "tests/distributed/test_nonfinite_update.py::test_a_non_finite_update_is_stopped_on_every_rank_before_the_optimizer[gradient]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[CP2rows]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[CP2xEP2]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[CP2xPP2]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[CP2xTP2]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[DP2]",
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[packed1]",
    "tests/distributed/test_packed_gspo_step.py::test_reference_clips_on_both_sides",
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[DP2]",
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[EP2]",
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[PP2]",
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[TP2]",
    "tests/distributed/test_rl_trainer_layouts.py::test_later_objectives_train_under_data_parallelism_as_in_one_process",
    "tests/distributed/test_rl_trainer_layouts.py::test_reference_batch_exercises_the_weighting",
    "tests/distributed/test_rl_trainer_layouts.py::test_train_rollout_matches_single_process[DP2]",
    "tests/distributed/test_rl_trainer_layouts.py::test_train_rollout_matches_single_process[PP2]",
    "tests/distributed/test_rl_trainer_packed.py",
    "tests/distributed/test_routing_replay.py::test_each_rank_receives_only_the_routed_experts_of_its_own_rows",
    "tests/distributed/test_routing_replay.py::test_replay_changes_the_update",
    "tests/distributed/test_routing_replay.py::test_replay_of_unchanged_routing_is_bit_equal",
    "tests/distributed/test_routing_replay.py::test_replay_under_expert_and_tensor_parallelism[TP2xEP2]",
    "tests/distributed/test_routing_replay.py::test_rollout_replay_under_pipeline_and_packed_context_parallelism",
    "tests/distributed/test_scoring_layouts.py",
    "tests/distributed/test_sft_checkpoint.py",
    "tests/distributed/test_uneven_pipeline.py",
    "tests/e2e/test_calibrate_eps.py",
    "tests/e2e/test_gspo_context_parallel.py",
    "tests/e2e/test_gspo_run.py",
    "tests/e2e/test_parity_watchdog.py",
    "tests/e2e/test_routing_replay_run.py",
    "tests/e2e/test_sft_demo.py",
    "tests/e2e/test_tools_demo.py",
    "tests/reliability/test_dead_server.py::test_a_killed_server_is_restarted_out_of_the_router_until_admitted",
    # the rollout producer process (issue 37 item 6): 2.7-3.7 s each on the quiet machine,
    # 3.5-16 s under load (a producer started per test); its error and death tests (~2.3 s)
    # stay in the fast tier
    "tests/reliability/test_producer_process.py::test_one_step_in_its_process_makes_the_threads_batches_and_state",
    "tests/reliability/test_producer_process.py::test_full_streams_in_its_process",
    "tests/reliability/test_producer_process.py::test_the_producer_dies_with_the_process_that_started_it",
    "tests/reliability/test_producer_process.py::test_a_stop_signal_on_rank0_abandons_the_producers_reward_call",
    "tests/reliability/test_dead_server.py::test_a_rollout_waits_for_its_only_server_to_come_back_synced",
    "tests/reliability/test_dead_server.py::test_a_rollout_whose_server_cannot_come_back_names_it_and_the_wait",
    "tests/reliability/test_dead_server.py::test_below_min_servers_the_error_names_the_server",
    "tests/reliability/test_dead_server.py::test_distributed_sync_reaches_a_restarted_server_through_new_groups",
    "tests/reliability/test_dead_server.py::test_external_mode_waits_for_the_router_to_have_a_server_again",
    "tests/reliability/test_dead_server.py::test_full_mode_the_trainers_sync_reaches_a_server_the_stream_waits_for",
    "tests/reliability/test_helpers_survive.py",
    "tests/reliability/test_run_lock.py::test_another_hosts_lock_is_stale_once_its_heartbeat_stops",
    "tests/rollout/test_cluster.py::test_killed_server_loses_nothing_and_the_restarted_one_rejoins",
    "tests/rollout/test_weight_sync.py::test_bf16_delta_syncs_are_bit_exact",
    "tests/rollout/test_weight_sync.py::test_disk_pushes_overwrite_the_retired_version_in_place",
    "tests/rollout/test_weight_sync.py::test_every_layout_syncs_checksum_verified",
    "tests/rollout/test_weight_sync.py::test_group_keys_meet_sglangs",
    "tests/rollout/test_weight_sync.py::test_one_sender_per_node_or_stage_syncs_the_same_weights",
    "tests/rollout/test_weight_sync.py::test_server_logprobs_match_megatron_recomputation",
    "tests/slurm/test_render.py::test_unhealthy_server_fails_the_job_naming_it",
    # the vLLM job against fake Slurm: 10.8 s and 3.6 s (the SGLang job's fake run stays in the
    # fast tier for the flow both share)
    "tests/slurm/test_vllm_cli.py::test_vllm_job_runs_without_a_router_and_hands_the_trainer_its_servers",
    "tests/slurm/test_vllm_cli.py::test_unhealthy_vllm_server_fails_the_job_naming_it",
    "tests/unit/test_benign_warnings.py::test_megatrons_import_time_notices_are_silenced_without_cuda",
    "tests/unit/test_benign_warnings.py::test_on_a_gpu_machine_a_missing_transformer_engine_stays_loud",
    "tests/unit/test_cpu_compat.py::test_each_accommodation_is_still_needed[maybe_move]",
    "tests/unit/test_cpu_compat.py::test_each_accommodation_is_still_needed[recompute_rng]",
    "tests/unit/test_cpu_compat.py::test_each_accommodation_is_still_needed[te_general_gemm]",
    "tests/unit/test_cpu_compat.py::test_uneven_gather_and_reduce_scatter_over_gloo",
    "tests/unit/test_gpu_path.py::test_forward_only_passes_build_no_autograd_graph",
    "tests/unit/test_gpu_path.py::test_rank_zero_broadcasts_travel_on_the_gloo_control_group_with_its_own_timeout",
    "tests/unit/test_memory_plan.py::test_local_spec_activation_bytes_equal_the_tensors_autograd_saves",
    "tests/unit/test_memory_plan.py::test_parameter_counts_match_the_real_policy_on_every_rank[4-layouts0]",
    "tests/unit/test_reward_deadline.py::test_a_timeout_kills_what_the_function_started",
    # moved out of the fast tier on 2026-12-07 (it measured 300 s at 6787025 on the quiet 2-core
    # machine, MGSPO_TEST_TIMES): seconds each
    "tests/unit/test_cross_rank_errors.py::test_a_crash_on_rank_0_is_a_crash_on_every_rank",  # 4.8
    "tests/unit/test_cross_rank_errors.py::test_the_run_lock_and_the_row_scatter_raise_rank_0s_error_on_every_rank",  # 4.8
    # (a module-scoped fixture's setup goes with the last of its tests in the fast tier: these
    # modules go whole)
    "tests/reliability/test_checkpoint_integrity.py",  # 10.1
    "tests/reliability/test_checkpoint_tampering.py",  # 7.3
    "tests/reliability/test_dead_server.py::test_router_and_server_logs_rotate_at_their_bound",  # 6.1
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_batch_has_holes_that_change_the_step",  # 9.8 (its fixture's only fast test)
    "tests/distributed/test_routing_replay.py::test_replayed_gates_differ_exactly_where_expert_sets_differ",  # 8.9 (its fixture's other test is slow)
    "tests/rollout/test_weight_sync.py::test_sync_makes_servers_serve_the_new_weights",  # 8.9
    "tests/unit/test_cpu_compat.py::test_cuda_device_arguments_go_to_the_cpu",  # 4.5
    "tests/reliability/test_refused_update.py",  # 14 (a server of its own)
)


EXTENDED = (
    "tests/e2e/test_calibrate_eps.py::test_calibrate_eps_prints_and_writes_the_range",          # 114 s
    "tests/slurm/test_slurm_jobs.py::test_requeued_job_resumes_without_losing_or_repeating_a_step",  # 110 s
    "tests/e2e/test_gspo_run.py::test_kill9_of_a_training_rank_then_resume_is_exact",           # 67 s
    "tests/gpu/test_gpu_smoke.py::test_every_check_passes_on_cpu",                              # 40 s
    "tests/e2e/test_parity_watchdog.py::test_watchdog_passes_a_faithful_server_and_stops_a_perturbed_one",  # 34 s
    "tests/e2e/test_sft_demo.py::test_sft_checkpoints_and_resume_from_the_command_line",        # 28 s
    "tests/distributed/test_scoring_layouts.py",                                               # 28 s
    # measured with MGSPO_TEST_TIMES on 2026-12-05 (the suite at 25:36 with the multi-turn tests)
    # 60 s (2); since issue 35 a third interpreter per direction (run.init_from of the other
    # stack's saves): 4:07 for both, measured beside three other sessions' work on 2026-12-07
    "tests/distributed/test_cross_stack_checkpoint.py",
    "tests/slurm/test_slurm_jobs.py::test_gspo_job_completes_with_rising_reward",              # 54 s
    "tests/distributed/test_memory_layouts.py::test_uneven_pipeline_stages_match_single_process",  # 22 s
    # moved out of the README's suite on 2026-12-07 (issue 34: the suite under 20 minutes; seconds
    # measured with MGSPO_TEST_TIMES on a loaded 2-core machine, the suite at 29:18): the e2e runs
    # that need the session SFT policy (its ~90 s go with them), and the layout cases whose area
    # keeps other cases in the suite
    "tests/e2e/test_gspo_run.py::test_gspo_reward_rises_and_metrics_are_written",    # 125 s (SFT)
    "tests/e2e/test_routing_replay_run.py",                                          # 19 s
    "tests/distributed/test_rl_trainer_layouts.py::test_later_objectives_train_under_data_parallelism_as_in_one_process[cispo]",  # 13 s
    "tests/distributed/test_rl_trainer_layouts.py::test_later_objectives_train_under_data_parallelism_as_in_one_process[gmpo]",   # 13 s
    "tests/distributed/test_rl_trainer_layouts.py::test_later_objectives_train_under_data_parallelism_as_in_one_process[luspo]",  # 13 s
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[CP2]",  # 6 s
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[DP2]",  # 6 s
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[PP2]",  # 7 s
    "tests/distributed/test_packed_gspo_step.py::test_multiturn_step_matches_single_process[TP2]",  # 6 s
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[DP2]",              # 12 s
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[TP2xEP2xETP2]",     # 12 s
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[DP2]",     # 7 s
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[PP2]",     # 6 s
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[TP2]",     # 7 s
    "tests/rollout/test_weight_sync.py::test_every_layout_syncs_checksum_verified[DP2]",         # 6 s
    "tests/rollout/test_weight_sync.py::test_every_layout_syncs_checksum_verified[TP2]",         # 6 s
    # moved out of the README's suite on 2026-12-07, second pass (the suite measured 23:40 at
    # 6787025 on the quiet 2-core machine: fast tier 5:00 + the rest 18:40, MGSPO_TEST_TIMES);
    # seconds each, in that run
    "tests/slurm/test_slurm_jobs.py::test_server_that_cannot_start_fails_the_job_naming_it",  # 85 (starts Slurm, as the extended tier does anyway)
    "tests/e2e/test_tools_demo.py",                                                  # 51
    "tests/distributed/test_convert.py",                                             # 34 (also on the 3.12 stack)
    "tests/e2e/test_recipes_train.py::test_recipe_trains_two_steps_against_sglang_conformant_servers[qwen3_235b_a22b]",  # 22
    "tests/reliability/test_dead_server.py::test_train_survives_its_only_server_dying_mid_rollout",  # 23
    "tests/rollout/test_nccl_ordering.py",                                           # 18
    "tests/unit/test_cpu_compat.py::test_uneven_gather_and_reduce_scatter_over_gloo",  # 18 (also on the 3.12 stack)
    "tests/unit/test_cpu_compat.py::test_each_accommodation_is_still_needed[maybe_move]",  # 15 (also on the 3.12 stack)
    "tests/unit/test_benign_warnings.py::test_on_a_gpu_machine_a_missing_transformer_engine_stays_loud",  # 16
    "tests/unit/test_gpu_path.py::test_rank_zero_broadcasts_travel_on_the_gloo_control_group_with_its_own_timeout",  # 15
    "tests/unit/test_memory_plan.py::test_parameter_counts_match_the_real_policy_on_every_rank[4-layouts0]",  # 13
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[PP2xTP2]",  # 11
    "tests/distributed/test_packed_gspo_step.py::test_packed_step_matches_single_process_padded[CP2xPP2]",  # 11
    "tests/distributed/test_gspo_layouts.py::test_gspo_gradients_match_single_process[DP2xPP2]",  # 10
    # issue 37 (2026-12-07, beside other work): FP8 weights through every transport to two
    # servers with SGLang's weight-update code (the unit tests keep the format in the suite)
    "tests/rollout/test_fp8_sync.py",                                                # 46
    # 2026-12-07, the runs issue 38 added (seconds measured beside other work): the README's
    # suite keeps one run per fault in the reliability tests; these repeat a kind it has
    "tests/reliability/test_dead_server.py::test_train_survives_its_only_server_dying_in_an_async_mode",  # 2 x 28
    "tests/reliability/test_tool_stop.py",                                            # 25
    "tests/distributed/test_nonfinite_update.py::test_a_non_finite_update_is_stopped_on_every_rank_before_the_optimizer[gradient]",  # 20
    # 2026-12-07, issue 37 item 1's acceptance (the router during a long weight sync): 3-step
    # runs in each rollout.async mode, ~12 s of waiting for the router after each of 4 syncs
    "tests/reliability/test_long_sync_pause.py",  # 7-9 (server, router) + 78-103 / 73-91 / 68-90
    # issue 37 item 2 (2 ranks, 3 steps, a checkpoint and an export: 28 s beside other work)
    "tests/distributed/test_param_gather.py",                                         # 28
    # issue 37 item 7 (one rank, a real checkpoint; tests/unit/test_run_state.py stays in the suite)
    "tests/reliability/test_run_state_tensors.py",                                    # 14
)
