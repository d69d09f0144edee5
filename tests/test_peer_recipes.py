"""The calibration of the planner's estimates on MaxText's published runs (bench/peer_recipes.py):
the recipes' work and the arithmetic, on published and recorded figures (the compiles themselves
are bench/peer_plans.py --calibrate, a benchmark)."""

import pytest

from bench import peer_recipes


@pytest.mark.parametrize(
  'name,tokens_per_chip', [('mixtral_8x7b_dropped', 3897), ('mixtral_8x22b_dropped', 1326)]
)
def test_each_recipe_is_the_published_work(name, tokens_per_chip):
  """moetrain's plan of a recipe holds MaxText's tokens per step (per-device batch x rows x
  chips), and the published step time gives the published tokens/s/chip."""
  r = peer_recipes.RECIPES[name]
  mt = dict(kv.split('=', 1) for kv in r.maxtext)
  tokens = int(mt['per_device_batch_size']) * int(mt['max_target_length']) * r.chips
  assert r.overrides['data.global_batch_size'] * r.overrides['data.seq_len'] == tokens
  assert mt['compile_topology'] == r.topology
  out = peer_recipes.calibrate(r.measured_s, 1.0, 1.0, 1.0, tokens, r.chips)
  assert round(out['maxtext_measured_tokens_per_chip']) == tokens_per_chip
  # The same dispatch on both sides: token dropping at capacity factor 1.25.
  assert mt['capacity_factor'] == '1.25' and r.overrides['engine.moe_capacity_factor'] == 1.25
  assert r.overrides['engine.moe_dispatch'] == 'capacity'


def test_the_calibration_scales_moetrains_estimates_by_maxtexts_measured_over_estimated():
  out = peer_recipes.calibrate(
    measured_s=8.0, maxtext_est_s=4.0, moetrain_est_s=3.0, best_est_s=2.5,
    tokens_per_step=2048 * 4096, chips=256,
  )  # fmt: skip
  assert out['factor'] == 2.0
  assert out['moetrain_predicted_s'] == 6.0 and out['moetrain_best_predicted_s'] == 5.0
  assert out['best_over_measured'] == pytest.approx(8.0 / 5.0)
  assert out['moetrain_best_predicted_tokens_per_chip'] == pytest.approx(2048 * 4096 / 5.0 / 256)
