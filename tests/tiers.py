"""Which tests are in the full tier only: the one table conftest.py turns into ``full`` markers.

``bash scripts/dev test`` (the README's test command) runs the fast tier, ``-m "not full"``:
every module and every driver on its real engine, in a few minutes on a 2-core machine.
``bash scripts/dev test --all`` (what ``.ci/run`` calls) runs both tiers. A test is in the full
tier when it is a campaign (the SGLang scheduler clusters, the hostile fuzzing, soaks, sweeps,
the thousand-peer lifecycle) or when it repeats, on another variant or at a larger size, what a
faster test of the fast tier already shows on the same code. A pattern is a test's name with
its parameters (``test_x[nixl-ucx]``) in which ``*`` stands for anything; ``"*"`` takes a whole
file.

Measured on 2-core CPU machines (figures in the README): a test that takes seconds belongs here
unless it is the only one in the fast tier to reach a module or a driver's engine.
"""

from __future__ import annotations

import functools
import re

#: The conformance tests a driver's first variant runs in the fast tier: a verified write, a
#: chunked send with its aux slot, an abort with writes in flight confirmed drained, and
#: nothing written for bad pages, and a layer-wise send. Every test, on every variant, runs in
#: the full tier.
CONFORMANCE_CORE = (
    "test_write_and_verify_bytes",
    "test_layerwise_groups_out_of_order_and_in_flight",
    "test_chunked_send_with_aux",
    "test_an_abort_with_writes_in_flight_is_confirmed_drained",
    "test_bad_pages_submit_nothing",
)
#: Each conformance file's variants beyond its first (these run only in the full tier).
_CONFORMANCE_ENGINES_CORE = [f"{name}[nixl-ucx]" for name in CONFORMANCE_CORE] + [
    f"{name}[mooncake-gdr]" for name in CONFORMANCE_CORE
]
_CONFORMANCE_STAGED_CORE = [f"{name}[mooncake-default-ring]" for name in CONFORMANCE_CORE] + [
    f"{name}[nixl-tiny-ring]" for name in CONFORMANCE_CORE
]

#: file stem -> patterns of its full-tier tests.
FULL: dict[str, list[str]] = {
    # the SGLang scheduler clusters: SGLang's own prefill and decode schedulers in processes
    "test_sglang_scheduler": ["*"],
    # the short open-loop replay of Mooncake's trace (four passes, about two minutes); the
    # reader, the arrivals, the prefix cache and the CLI's refusals stay in the fast tier
    "test_trace": ["test_a_short_replay_of_the_trace_*"],
    # vLLM's own scheduler in prefill and decode processes (each start imports vLLM: seconds);
    # the connector's parts without vLLM (test_vllm_parts) stay in the fast tier
    "test_vllm": ["*"],
    # an SGLang prefill's scheduler feeding a vLLM decode's, each in its own process
    "test_cross_engine_cluster": ["*"],
    # discovery on etcd: the 1,000-route memory check (three rounds of register and expire), a
    # bad first member of each kind for three TTLs, a lone member's pauses, and a rank killed
    # during an etcd outage; registration, expiry, restarts, forgeries, a member that hangs
    # mid-life and a gone rank's route stay in the fast tier
    "test_discovery": [
        "test_a_thousand_routes_registered_and_expired_leave_the_client_flat",
        "test_a_bad_first_member_from_the_start_never_costs_a_rank_its_entry*",
        "test_a_refresh_that_fails_is_tried_again_before_the_lease_ends",
        "test_a_rank_killed_during_an_etcd_outage_is_gone_a_ttl_after_etcd_returns",
    ],
    # late writes of a stopped prefill, fenced: the fast tier keeps mooncake-gdr (an engine that
    # reconnects with writes still queued, the hardest to fence); the other drivers here
    "test_fence": [
        "test_a_stopped_prefills_late_writes_never_land_in_pages_given_back[nixl-*",
        "test_a_stopped_prefills_late_writes_never_land_in_pages_given_back[mooncake-staged]",
    ],
    # soaks: thousands of verified transfers with aborts (the fast tier keeps the soak's own check)
    "test_soak": ["test_soak_on_every_real_host_driver", "test_soak_of_a_connection_with_two_lanes"],
    # the hostile campaign (40,000 generated frames here; KVTRANSPORT_HOSTILE_MESSAGES for the
    # full size) and the slower single attacks; the
    # fast tier keeps the attacks that take under a second (a live victim each)
    "test_hostile": [
        "test_fuzz_*",
        "test_an_insider_cannot_impersonate_a_live_connection*",
        "test_a_stranger_cannot_impersonate_a_live_connection*",
        "test_a_kvtransport_endpoint_without_the_secret_is_refused*",
        "test_a_stranger_learns_nothing_and_changes_nothing*",
        "test_a_garbage_flood_does_not_starve_heartbeats",
        "test_one_peer_cannot_hoard_every_inbound_slot",
        "test_catalogue_staged_notice*",
        "test_a_replayed_hello_that_goes_quiet_does_not_cut_off_the_endpoint_it_copied",
        "test_a_second_connection_from_one_endpoint_is_refused_and_the_first_keeps_working",
        "test_hellos_reusing_one_connection_id_leak_no_threads",
        "test_a_frame_far_over_the_limit_is_not_buffered_whole",
        "test_sixteen_violations_close_the_session_with_a_bye",
        "test_hellos_with_a_corrupted_copy_of_another_endpoints_metadata",
        "test_a_nine_byte_field_does_not_allocate_hundreds_of_mib",
        "test_staged_ring_description_with_an_infinite_address",
        "test_early_expect_with_a_bad_aux_does_not_hang_the_victims_sender*",
        "test_one_slow_hello_does_not_stall_the_io_loop",
    ],
    # the sweep on real engines, and its listener; the fast tier keeps the grid, the
    # placements, the presets and the listener's argument checks
    "test_sweep": [
        "test_the_sweep_measures_every_path_on_real_engines_with_every_byte_checked",
        "test_sweep_cli_json_and_text",
        "test_one_workload_between_hosts_runs_with_the_benchs_own_flags",
        "test_a_sweep_runs_its_decode_sides_through_a_listener",
        "test_a_corrupted_page_or_state_slot_fails_the_sweep*",
        "test_a_raw_engine_that_writes_nothing_is_caught",
        "test_a_stranger_that_sends_nothing_or_floods_cannot_stop_the_listener",
    ],
    # the conformance suite: its core on each driver in the fast tier, all of it here
    "test_conformance_engines": ["*"],
    "test_conformance_staged": ["*"],
    # 1,000 peers and 10,000 aborted batches
    "test_lifecycle": [
        "test_a_thousand_peers_that_come_and_go_leave_nothing_behind",
        "test_ten_thousand_aborted_batches_leave_no_handle_in_any_driver",
        "test_connections_that_carry_no_session_are_bounded_in_number_and_time",
        "test_an_idle_endpoint_does_not_wake_up",
    ],
    # every TP pair; the fast tier keeps 1 -> 2 and 2 -> 1, and the staged gather of slices
    "test_unequal_tp": [
        "test_every_head_arrives_once_from_the_right_rank[2-4-*",
        "test_every_head_arrives_once_from_the_right_rank[4-*",
        "test_every_head_arrives_once_from_the_right_rank[1-4-*",
        "test_every_head_arrives_once_from_the_right_rank[1-2-4-False]",
        "test_every_head_arrives_once_from_the_right_rank[2-1-0-True]",
        "test_a_destination_announced_to_the_wrong_ranks_is_refused_before_anything_moves",
        "test_an_abort_of_one_part_fails_every_source",
        "test_a_source_killed_mid_request_fails_the_request_and_stops_the_others",
    ],
    # the bench: the fast tier keeps one verified run against the raw engine per engine family
    "test_bench": [
        "test_bench_with_unequal_tp_checks_every_head*",
        "test_bench_across_engines_regroups_pages_with_every_head_checked*",
        "test_bench_moves_verified_bytes_and_compares_with_the_raw_engine[None]",
        "test_bench_pin_runs_each_process_on_cpus_of_its_own_and_gives_them_back",
        "test_bench_compares_a_staged_driver_with_the_driver_it_stages_over",
        "test_bench_text_report_names_driver_ratio_and_integrity",
    ],
    "test_staging": [
        "test_chunks_cover_every_byte_once_in_order_and_fit_their_slot",
        "test_real_engine_transfers_larger_than_the_ring_concurrently[0.01-*",
        "test_ten_thousand_transfers_leave_no_slot_behind",
        "test_real_engine_announcement_lends_slots_that_come_back_unused*",
        "test_real_engine_receiver_killed_mid_stream*",
    ],
    "test_calibration": [
        "test_calibrate_measures_real_engines_saves_and_endpoints_then_rank_by_it",
        "test_each_transfer_takes_the_lane_its_shape_favours_on_real_engines*",
        "test_calibrate_towards_a_listener_files_the_models_under_the_far_host",
    ],
    "test_bootstrap": [
        "test_decode_learns_a_rooms_dp_rank_through_sglangs_own_query",
        "test_keep_registered_outlives_the_ttl_until_unregistered",
    ],
    # SGLang's classes on both engines: the fast tier keeps one request with aux on each
    "test_sglang": [
        "test_a_room_goes_only_to_the_decode_rank_the_registry_pairs_with_it",
        "test_decode_waiting_timeout*",
        "test_prefill_killed_mid_transfer_fails_decode_with_peer_lost*",
        "test_a_decode_managers_tables_are_bounded",
        "test_a_pool_with_state_kvtransport_does_not_move_is_refused_at_start_up*",
        "test_different_tp_sizes_without_the_models_heads_are_refused_clearly*",
        "test_pages_wait_for_the_forward_sglang_asked_the_sender_to_wait_for*",
    ],
    # SGLang's own argument resolution in a process (seconds); the manager's refusal of the
    # same policy is in the fast tier (test_sglang)
    "test_sglang_plugin": [
        "test_without_the_plugin_sglang_refuses_the_backend_name",
        "test_sglang_refuses_the_prefill_complete_allocation_policy_for_this_backend",
    ],
    "test_engine_faults": [
        "test_peer_advertising_unusable_connection_info_is_refused_and_others_still_served*",
        "test_decode_killed_mid_transfer_fails_typed_and_prefill_serves_others[mooncake-gdr]",
    ],
    "test_security": [
        "test_doctor_says_whether_the_control_plane_is_authenticated",
        "test_a_stranger_learns_a_nonce_and_authentication_failed_nothing_else",
    ],
    "test_express": ["test_a_peer_that_reads_nothing_costs_only_its_own_session"],
    # across simulated hosts: the fast tier keeps the cluster's sweep, the bench's flags and the
    # KV crossing a rail on mooncake-gdr; every driver, every kind of partition, SGLang's classes
    # and the bench across hosts here
    "test_cluster": [
        "test_two_hosts_share_nothing_and_the_kv_crosses_the_rail[mooncake-staged]",
        "test_two_hosts_share_nothing_and_the_kv_crosses_the_rail[nixl-*",
        "test_a_silent_partition_fails_every_transfer_in_time_and_no_late_write_lands*",
        "test_a_partition_of_a_connection_learning_its_lanes_fences_every_lane",
        "test_sglangs_schedulers_see_a_partition_as_failed_requests_in_time",
        "test_vllms_schedulers_see_a_partition_as_a_failed_load_and_serve_on",
        "test_bench_across_hosts_shows_where_the_bytes_went_and_what_a_cut_did",
        "test_an_uncalibrated_pair_of_hosts_learns_which_lane_is_fastest_across_the_link",
        "test_learning_connections_that_come_and_go_leave_both_hosts_flat",
    ],
    # failover: the fast tier keeps the fakes' cases, the real engines failing with errors, and
    # the cut data rail across simulated hosts (tests/test_cluster_failover.py, seconds)
    "test_failover": [
        "test_real_engines_fail_over_between_processes_byte_exact[stall]",
        "test_real_engines_fail_over_between_processes_byte_exact[error-then-back]",
    ],
    # pacing: the fast tier keeps the head-of-line property on nixl-ucx
    "test_pacing": [
        "test_small_requests_do_not_wait_for_a_large_one_on_the_same_connection[mooncake-*",
    ],
    "test_cli": [
        "test_negotiate_with_a_misspelled_driver_fails_with_a_suggestion",
        "test_negotiate_with_nothing_allowed_fails_listing_reasons",
        "test_negotiate_honours_the_forced_driver",
    ],
}
#: The conformance tests that stay in the fast tier despite the files' "*" above.
FAST_EXCEPTIONS: dict[str, list[str]] = {
    "test_conformance_engines": _CONFORMANCE_ENGINES_CORE,
    "test_conformance_staged": _CONFORMANCE_STAGED_CORE,
}


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(".*".join(map(re.escape, pattern.split("*"))))


def matches(name: str, pattern: str) -> bool:
    """Whether a test's name (with its parameters) is one that ``pattern`` names."""
    return _compiled(pattern).fullmatch(name) is not None


def in_full_tier(stem: str, name: str) -> bool:
    """Whether test ``name`` of file ``tests/<stem>.py`` runs only in the full tier."""
    return any(matches(name, p) for p in FULL.get(stem, ())) and not any(
        matches(name, p) for p in FAST_EXCEPTIONS.get(stem, ())
    )
