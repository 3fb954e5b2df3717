"""``gspo.routing_replay: rollout`` end to end on two ranks (EP2, data-parallel 2 for the dense
part): the servers return the experts they routed every token to, the loop keeps that tensor out
of the batch's broadcast and sends each rank only the rows it trains on
(``RLTrainer.scatter_routed_experts``), and the trainer replays them. With the same fp32 weights on
both sides the replayed pi_old equals the servers' log-probs: a row given another row's experts
would not (the routes of another sequence move the log-probs by far more than the bound)."""

from __future__ import annotations

from pipeline.observe.metrics import read_metrics
from tests.e2e.conftest import megatron_gspo, train_args


def test_rollout_replay_trains_on_each_ranks_own_rows(sft_policy, tmp_path):
    run_dir = tmp_path / "r3"
    megatron_gspo(*train_args(run_dir, sft_policy, "run.num_steps=3", "run.eval_interval=0",
                              "run.save_interval=0", "run.global_batch_size=64",
                              "gspo.routing_replay=rollout", "gspo.routing_metrics=true"),
                  timeout=900)
    records = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["train/rollout_trainer_logprob_abs_diff"] < 1e-4, r
        assert "train/routing_change_frac" in r
