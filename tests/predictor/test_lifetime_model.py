"""The lifetime model: uptime augmentation, a distribution that follows the data and the
uptime, the compiled trees agreeing with scikit-learn, save/load, and the fallback prior."""

import pickle

import numpy as np
import pytest

from services.predictor.lifetime_model import (
    MODEL_FORMAT,
    FeatureSchema,
    LifetimeModel,
    ModelError,
    UptimePrior,
    augment,
    load_model,
)

H = 3600.0


def test_augment_repeats_each_vm_at_eighths_of_its_lifetime():
    rows, uptime, remaining = augment(np.array([8.0, 80.0]))
    assert rows.tolist() == [0] * 8 + [1] * 8
    assert uptime[:8].tolist() == list(range(8))
    assert remaining[8:].tolist() == [80.0 - 10 * k for k in range(8)]
    assert np.all(remaining > 0)


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
