"""`ragkv calibrate` and what `--mode approximate` becomes on a calibrated store: the measured
mode and share, or exact answers when nothing reached the target (the gate)."""

from __future__ import annotations

import json
import shutil

import pytest

import ragkv
from ragkv.core.config import AskSettings
from ragkv.core.errors import InputError
from ragkv.modes.calibration import Calibration, Measured, choose, lower_bound, meta_key, resolve
from ragkv.pipelines.calibrate import CalibrateSettings, calibrate, held_in_questions
from ragkv.pipelines.progress import default_reporter
from ragkv.store import open_snapshot, verify
from ragkv.store.writer import open_writer
from tests.conftest import QUESTIONS, run_cli

PASSED = Measured("query", 0.3, 0.95, 0.97, 0.4)
FAILED = Measured("epic", 0.5, 0.6, 0.8, 0.5)


@pytest.fixture
def store(tiny_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(tiny_store, copy)
    return copy


def record(store, calibration: Calibration) -> None:
    with open_snapshot(store) as snapshot:
        profile_id = snapshot.catalog.meta()["last_profile"]
    with open_writer(store) as writer:
        writer.catalog.set_meta({meta_key(profile_id): calibration.to_json()})


def test_a_calibration_round_trips_and_says_what_it_measured():
    calibration = Calibration(0.9, 5, 12, 0.8, PASSED, [FAILED, PASSED])
    assert Calibration.from_json(calibration.to_json()) == calibration
    assert "query 30%: 95% first-token" in calibration.describe()
    gated = Calibration(0.9, 5, 12, 0.8, None, [FAILED])
    assert Calibration.from_json(gated.to_json()) == gated
    assert "best 60%" in gated.describe()


def test_approximate_resolves_to_the_calibrated_mode_or_exact_and_other_modes_stay_as_asked():
    asked = AskSettings(top_k=5, mode="approximate")
    assert asked.blend_ratio is None  # resolved per store
    chosen = resolve(asked, Calibration(0.9, 5, 12, 0.8, PASSED, [PASSED]))
    assert (chosen.settings.mode, chosen.settings.blend_ratio, chosen.warnings) == ("query", 0.3, ())
    assert chosen.approximation.startswith("query 30%, calibrated")
    gated = resolve(asked, Calibration(0.9, 5, 12, 0.8, None, [FAILED]))
    assert gated.settings.mode == "exact" and "answered exactly" in gated.warnings[0] and "60%" in gated.warnings[0]
    unmeasured = resolve(asked, None)
    assert (unmeasured.settings.mode, unmeasured.settings.blend_ratio) == ("query", 0.2)
    assert "not calibrated" in unmeasured.warnings[0]
    own_share = resolve(AskSettings(mode="approximate", blend_ratio=0.5), Calibration(0.9, 5, 12, 0.8, PASSED, []))
    assert own_share.settings.blend_ratio == 0.5
    epic = AskSettings(mode="epic", blend_ratio=0.1)
    assert resolve(epic, Calibration(0.9, 5, 12, 0.8, None, [])).settings == epic


def test_a_gated_store_answers_approximate_questions_exactly(store):
    record(store, Calibration(0.9, 3, 4, 0.8, None, [FAILED]))
    with ragkv.open(store, device="cpu") as engine:
        exact = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=6)
        gated = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=6, mode="approximate")
    assert gated.token_ids == exact.token_ids and gated.stats.mode == "exact" and not gated.stats.is_approximate
    assert gated.stats.approximation == "exact (gated)" and "answered exactly" in gated.stats.warnings[0]


def test_a_calibrated_store_runs_the_measured_mode_and_share(store):
    record(store, Calibration(0.9, 3, 4, 0.8, PASSED, [PASSED]))
    with ragkv.open(store, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], top_k=3, max_new_tokens=4, mode="approximate")
    stats = answer.stats
    assert stats.mode == "query" and stats.recomputed_tokens > 0 and "calibrated" in stats.approximation
    assert not any("calibrated" in w for w in stats.warnings)


def test_calibrate_measures_stops_at_the_target_and_records_what_approximate_uses(store):
    settings = CalibrateSettings(questions=3, top_k=3, target=0.6, tokens=4, shares=(0.1, 0.5, 1.0))
    result = calibrate(store, settings, default_reporter(True), device="cpu")
    assert result.num_questions == 3 and result.measured
    for mode in settings.modes:
        mine = [m for m in result.measured if m.mode == mode]
        assert [m.share for m in mine] == list(settings.shares[: len(mine)])
        for m in mine:  # each chosen by its lower bound on 3 questions, never by its mean
            assert m.first_token_low == lower_bound(round(m.first_token * 3), 3) <= m.first_token
        assert all(m.assured < 0.6 for m in mine[:-1])  # it stopped at the first share that reached it
        assert mine[-1].assured >= 0.6  # at the latest at 100% recomputed, which is a full prefill
    if result.chosen is not None:
        assert result.chosen.assured >= 0.6 and result.chosen.ttft_ratio < result.exact_ttft_ratio
    with ragkv.open(store, device="cpu") as engine:
        assert engine.runtime.calibration == result
        stats = engine.ask(QUESTIONS[1], top_k=3, max_new_tokens=2, mode="approximate").stats
    assert stats.mode == (result.chosen.mode if result.chosen else "exact")
    with open_snapshot(store) as snapshot:
        assert verify(snapshot).ok


def test_held_in_questions_come_from_the_stores_chunks_in_several_shapes(store):
    with open_snapshot(store) as snapshot:
        questions = held_in_questions(snapshot.catalog, 6)
        texts = snapshot.catalog.documents.chunk_texts(sorted(snapshot.catalog.documents.chunk_ids())).values()
    assert len(questions) == 6 and len(set(questions)) == 6
    about = [q for q in questions if q.startswith("What does the text say about ")]
    statements = [q for q in questions if q.startswith("Is it true that ")]
    keywords = [q for q in questions if q not in about and q not in statements]
    assert about and statements and keywords  # not one shape only
    corpus = " ".join(texts).lower()
    for question in questions:
        topic = question.removeprefix("What does the text say about ").removeprefix("Is it true that ").rstrip("?")
        assert all(word.lower() in corpus for word in topic.split()[:3])


def test_a_configuration_passes_by_the_lower_end_of_its_interval_not_its_mean():
    assert lower_bound(0, 0) == 0.0 and lower_bound(0, 10) == 0.0
    assert round(lower_bound(12, 12), 2) == 0.88 and round(lower_bound(32, 32), 2) == 0.95
    assert lower_bound(30, 32) < 0.9 < 30 / 32  # a mean of 94% on 32 questions is not 90% assured
    assert lower_bound(31, 32) >= 0.9
    mean_only = Measured("query", 0.05, 30 / 32, 0.95, 0.3, lower_bound(30, 32))
    assured = Measured("query", 0.2, 31 / 32, 0.96, 0.4, lower_bound(31, 32))
    slow = Measured("blend", 0.5, 1.0, 1.0, 0.9, lower_bound(32, 32))
    assert choose([mean_only, assured, slow], 0.9, exact_ttft_ratio=0.8) == assured  # the faster one is not sure
    assert choose([mean_only, slow], 0.9, exact_ttft_ratio=0.8) is None  # nor is one slower than exact chosen
    stored = json.loads(Calibration(0.9, 5, 12, 0.8, PASSED, [PASSED]).to_json())
    for measured in (stored["chosen"], *stored["measured"]):
        del measured["first_token_low"]  # as recorded before calibration chose by the bound: read as the mean
    old = Calibration.from_json(json.dumps(stored))
    assert old.chosen is not None and old.chosen.assured == old.chosen.first_token == 0.95


def test_ingest_calibrates_when_asked(corpus, tiny_llama, tmp_path):
    store = tmp_path / "store"
    result = run_cli(
        "ingest", corpus, "--store", store, "--model", tiny_llama, "--device", "cpu", "--calibrate", "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    with ragkv.open(store, device="cpu") as engine:
        calibration = engine.runtime.calibration
        drawn = held_in_questions(engine.snapshot.catalog, 32)
    assert calibration is not None and report["calibration"] == calibration.describe()
    assert calibration.num_questions == len(drawn) > 0


def test_the_calibrate_command_reports_json_and_refuses_bad_settings(store):
    result = run_cli("calibrate", "--store", store, "--questions", "2", "--top-k", "3", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["num_questions"] == 2 and report["measured"] and report["summary"]
    with pytest.raises(InputError, match="--top-k"):
        CalibrateSettings(top_k=1)
    bad = run_cli("calibrate", "--store", store, "--target", "1.5")
    assert bad.exit_code == 2 and "--target" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
