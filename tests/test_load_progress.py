"""A load's progress: LoadPhase values, in the phases' order, each counting up to its total."""

from tests.support.budgets import streaming_budget
from tests.support.make_model import ModelSpec, write_model
from tierflow import Engine, LoadPhase

SPEC = ModelSpec(num_layers=4, hidden_size=128, ffn_size=256, num_heads=4, num_kv_heads=2)
CONTEXT = 128


def load_reports(model, **options) -> list[tuple]:
    calls = []
    with Engine.load(model, threads=1, context_length=CONTEXT, progress=lambda *call: calls.append(call),
                     **options):
        pass
    return calls


def phases(calls: list[tuple]) -> list[LoadPhase]:
    """The phases in the order they reported, each once."""
    return [phase for i, (phase, _, _) in enumerate(calls) if i == 0 or calls[i - 1][0] != phase]


def test_a_load_reports_load_phases_in_their_order(model_path):
    calls = load_reports(model_path)
    assert all(isinstance(phase, LoadPhase) for phase, _, _ in calls)
    seen = phases(calls)
    assert seen == sorted(seen, key=list(LoadPhase).index) and len(seen) == len(set(seen))


def test_a_phase_counts_up_to_its_total(model_path):
    calls = load_reports(model_path)
    for phase in set(phases(calls)):
        done = [d for p, d, _ in calls if p == phase]
        assert done == sorted(done)
    assert all(done <= total for _, done, total in calls if total > 0)


def test_a_load_ends_with_all_its_weights_loaded(model_path):
    phase, done, total = load_reports(model_path)[-1]
    assert phase == LoadPhase.LOADING and done == total > 0


def test_a_first_streamed_load_packs_the_weights_then_loads_them(tmp_path):
    model = write_model(tmp_path / "model.gguf", SPEC)
    streams = streaming_budget(model, CONTEXT, SPEC.num_layers - 1, ring_slots=2)  # reads a pack, built first
    calls = load_reports(model, cpu_memory=streams)
    assert phases(calls) == [LoadPhase.PACKING, LoadPhase.LOADING]
    packed = [(done, total) for phase, done, total in calls if phase == LoadPhase.PACKING]
    assert all(done <= total for done, total in packed) and packed[-1][0] == packed[-1][1] > 0
