"""The lifetime model: uptime augmentation, a distribution that follows the data and the
uptime, the compiled trees agreeing with scikit-learn, save/load, and the fallback prior."""

import pickle

import numpy as np
import pytest

from services.predictor.lifetime_model import (
    AUGMENT_GRID_S,
    MODEL_FORMAT,
    CompiledForest,
    FeatureSchema,
    LifetimeModel,
    ModelError,
    UptimePrior,
    augment,
    augment_weights,
    load_model,
)

H = 3600.0


def test_augment_repeats_each_vm_at_the_grid_uptimes_it_lived_past():
    rows, uptime, remaining = augment(np.array([250.0, 700.0]), grid_s=np.array([300.0, 600.0]))
    assert rows.tolist() == [0, 1, 1, 1]
    assert uptime.tolist() == [0.0, 0.0, 300.0, 600.0]
    assert remaining.tolist() == [250.0, 700.0, 400.0, 100.0]


def test_rows_at_an_uptime_are_the_vms_alive_then_weighted_by_the_time_they_stand_for():
    life = np.array([0.5, 2.0, 50.0]) * H
    rows, uptime, _ = augment(life)
    at_1h = uptime == AUGMENT_GRID_S[np.searchsorted(AUGMENT_GRID_S, H)]
    assert sorted(rows[at_1h].tolist()) == [1, 2]  # the two VMs alive at ~1 h, long one too
    weight = augment_weights(rows, uptime, life)
    assert np.all(weight[uptime == 0] == 1.0)  # one question at placement per VM
    # After that, in proportion to the time alive, in total as much as the placements.
    later = uptime > 0
    assert weight[later].sum() == pytest.approx(3.0)
    spans = [life[vm] - uptime[(rows == vm) & later].min() for vm in range(3)]
    per_vm = [weight[(rows == vm) & later].sum() for vm in range(3)]
    np.testing.assert_allclose(np.array(per_vm) / sum(per_vm), np.array(spans) / sum(spans))


def test_re_predictions_of_young_vms_follow_the_survivors(train_trace, tiny_model):
    """E[remaining | uptime] at 1 h is the mean remaining lifetime of the VMs alive at 1 h
    (the issue's fraction-of-lifetime augmentation predicted about a sixth of it)."""
    life = train_trace.lifetime_s
    alive = np.flatnonzero(life > H)
    features = train_trace.feature_dicts(alive)
    predicted = tiny_model.predict(features, np.full(len(alive), H)).expected_remaining_s
    assert predicted.mean() == pytest.approx((life[alive] - H).mean(), rel=0.25)


def test_schema_numeric_and_ranked_categories():
    schema = FeatureSchema.fit(
        {"user": ["a", "b", "a", "c"], "cores": ["1", "2", "4", ""]},
        np.array([10.0, 1e6, 20.0, 1e3]),
    )
    assert schema.names == ["cores", "user"] and schema.numeric == [True, False]
    assert schema.vocab[1] == {"a": 0.0, "c": 1.0, "b": 2.0}  # by mean lifetime
    X = schema.encode([{"user": "b", "cores": "8"}, {"user": "zzz"}, {}])
    assert X[0].tolist() == [8.0, 2.0]
    assert np.isnan(X[1:]).all()  # unseen and missing values are "missing"


def test_short_users_are_predicted_shorter_than_long_ones(tiny_model, train_trace):
    feats = train_trace.feature_dicts()
    est = tiny_model.predict(feats, np.zeros(len(feats)))
    short = train_trace.lifetime_s < H
    assert np.median(est.expected_remaining_s[~short]) > 3 * np.median(
        est.expected_remaining_s[short]
    )
    # Quantiles are ordered, and the median covers about half the VMs.
    assert np.all(np.diff(est.quantiles_s, axis=1) >= 0)
    assert est.quantile_levels == (0.1, 0.5, 0.9)
    covered = (train_trace.lifetime_s <= est.quantiles_s[:, 1]).mean()
    assert 0.35 <= covered <= 0.65
    assert set(est.lifetime_class.tolist()) <= {1, 2, 3, 4}


def test_uptime_raises_the_remaining_lifetime_of_a_bimodal_group(tiny_model, train_trace):
    # A VM of a mixed user that survived its first 2 hours is probably of the long mode.
    kinds = train_trace.features["category"]
    row = dict(train_trace.feature_dicts(np.flatnonzero(kinds == "unknown")[:1])[0])
    est = tiny_model.predict([row, row], [0.0, 2 * H])
    assert est.expected_remaining_s[1] > 2 * est.expected_remaining_s[0]


def test_compiled_trees_agree_with_scikit_learn(tiny_model, train_trace):
    X = tiny_model.schema.encode(train_trace.feature_dicts(np.arange(40)))
    X[3, 0] = np.nan  # missing values take the trained side
    uptime = np.random.default_rng(0).uniform(0, 50 * H, 40)
    fast = tiny_model.predict_encoded(X, uptime)
    assert tiny_model.compiled() is not None
    slow_model = pickle.loads(pickle.dumps(tiny_model))
    slow_model.COMPILED_MAX_ROWS = 0
    slow = slow_model.predict_encoded(X, uptime)
    assert np.allclose(fast.expected_remaining_s, slow.expected_remaining_s, rtol=1e-9)
    assert np.allclose(fast.quantiles_s, slow.quantiles_s, rtol=1e-9, atol=1e-6)
    assert np.allclose(tiny_model.predict_expected(X, uptime), slow.expected_remaining_s, rtol=1e-9)


def test_fused_forest_equals_each_scikit_learn_model(tiny_model, train_trace):
    """The four models' trees fused into one lock-step pass give each model's own raw
    prediction, for one row and for batches, with values missing on either side."""
    models = [tiny_model.mean_model, *tiny_model.quantile_models]
    forest = CompiledForest(models)
    assert forest.models == 4 and forest.active == sorted(forest.active, reverse=True)
    X = tiny_model.schema.encode(
        train_trace.feature_dicts(np.arange(64)),
        np.random.default_rng(1).uniform(0, 100, 64).tolist(),
    )
    X[::5, 0] = np.nan
    X[::7, :] = np.nan  # every feature and the uptime missing
    X[1::9, -1] = np.nan
    expected = np.stack([m._raw_predict(X)[:, 0] for m in models], axis=1)
    one_by_one = np.concatenate([forest.raw(X[i : i + 1]) for i in range(len(X))])
    np.testing.assert_allclose(one_by_one, expected, rtol=1e-9, atol=1e-12)
    for rows in (2, 7, 32):
        batched = np.concatenate([forest.raw(X[i : i + rows]) for i in range(0, len(X), rows)])
        np.testing.assert_allclose(batched, expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="feature columns"):
        forest.raw(X[:1, :-1])


def test_encode_with_uptime_is_the_encoding_plus_the_uptime_column(tiny_model, train_trace):
    feats = [*train_trace.feature_dicts(np.arange(5)), {}, {"cores": "x", "user": "nobody"}]
    uptime_h = [0.0, 1.0, 2.5, 3.0, 100.0, 4.0, 5.0]
    X = tiny_model.schema.encode(feats)
    np.testing.assert_array_equal(
        tiny_model.schema.encode(feats, uptime_h), np.hstack([X, np.c_[uptime_h]])
    )
    assert np.isnan(X[5:]).all()  # missing, unseen and unparsable values
    assert tiny_model.schema.encode([]).shape == (0, len(tiny_model.schema.names))
    many = [*train_trace.feature_dicts(np.arange(100)), *feats]  # past ROW_WISE_MAX
    hours = np.arange(len(many), dtype=np.float64).tolist()
    assert len(many) > tiny_model.schema.ROW_WISE_MAX
    np.testing.assert_array_equal(
        tiny_model.schema.encode(many, hours),
        np.vstack(
            [tiny_model.schema.encode(many[i : i + 9], hours[i : i + 9]) for i in range(0, 107, 9)]
        ),
    )
    fast = tiny_model.predict(feats, np.array(uptime_h) * H)
    via_encoded = tiny_model.predict_encoded(X, np.array(uptime_h) * H)
    np.testing.assert_array_equal(fast.quantiles_s, via_encoded.quantiles_s)
    np.testing.assert_array_equal(fast.expected_remaining_s, via_encoded.expected_remaining_s)


def test_save_and_load_round_trip(tiny_model, tiny_model_path, train_trace):
    loaded = load_model(tiny_model_path)
    assert isinstance(loaded, LifetimeModel)
    feats = train_trace.feature_dicts(np.arange(5))
    a = tiny_model.predict(feats, np.zeros(5))
    b = loaded.predict(feats, np.zeros(5))
    assert np.allclose(a.expected_remaining_s, b.expected_remaining_s)


def test_load_explains_what_is_wrong(tmp_path):
    with pytest.raises(ModelError, match="cannot read lifetime model"):
        load_model(tmp_path / "missing.pkl")
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(ModelError, match="is not a lifetime model"):
        load_model(junk)
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"format": "something else"}))
    with pytest.raises(ModelError, match="no 'megha-lifetime-model' tag"):
        load_model(other)
    old = tmp_path / "old.pkl"
    old.write_bytes(pickle.dumps({"format": MODEL_FORMAT, "version": 0, "model": None}))
    with pytest.raises(ModelError, match=r"version 0 lifetime model.*retrain"):
        load_model(old)


def test_uptime_prior_is_the_documented_lomax():
    prior = UptimePrior()
    est = prior.predict([{}, {"user": "ignored"}], [0.0, 3 * H])
    assert est.expected_remaining_s.tolist() == pytest.approx([2 * H, 8 * H])
    median = est.quantiles_s[:, est.quantile_levels.index(0.5)]
    assert median[0] == pytest.approx(H * (2 ** (2 / 3) - 1))  # about 35 min
    assert median[1] == pytest.approx(4 * median[0])
    assert np.all(np.diff(est.quantiles_s, axis=1) > 0)
