"""`splitserve calibrate-route`: the threshold puts the target share of reference prompts below
it (RouteLLM's calibration), and the snippet it writes is a valid cascade route."""

from __future__ import annotations

import pytest
import yaml

from splitserve.cluster.cli.main import main
from splitserve.cluster.frontend.model_router.route_calibration import measure, pick_threshold, reference_prompts
from splitserve.cluster.model_route_config import ModelRouteConfig
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.llm_engine import LLMEngine
from tests.helpers.model import READS_TRAINED_CHECKPOINT


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_threshold_leaves_the_target_share_below_it(share):
    confidences = [0.9, 0.1, 0.5, 0.7, 0.3, 0.3, 0.95, 0.2]
    threshold = pick_threshold(confidences, share)
    assert sum(c < threshold for c in confidences) == round(share * len(confidences))
    assert 0 <= threshold <= 1


def test_a_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        pick_threshold([0.5], 1.5)


@READS_TRAINED_CHECKPOINT
def test_calibrate_route_writes_a_cascade_route_at_the_target_share(models_root, tmp_path, capsys):
    small = cached_checkpoint(ModelSpec("draft", "llama", seed=0, train_steps=300)).path  # the shared model cache
    large = cached_checkpoint(ModelSpec("draft", "llama", seed=1), root=models_root).path
    out = tmp_path / "route.yaml"
    argv = ["calibrate-route", "--small", str(small), "--large", str(large), "--small-name", "s", "--large-name", "l"]
    argv += ["--large-share", "0.25", "--large-share", "0.5", "--num-prompts", "4", "--window-tokens", "4"]
    argv += ["--max-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    snippet = yaml.safe_load(out.read_text())
    (route,) = [ModelRouteConfig.model_validate(r) for r in snippet["model_routes"]]
    assert (route.name, route.policy, route.cascade.small, route.cascade.large) == ("auto", "cascade", "s", "l")
    assert route.cascade.window_tokens == 4
    threshold = route.cascade.threshold
    # The same measurement, repeated: a quarter of the 8 reference prompts fall below it.
    measures = measure(LLMEngine.from_model_dir(str(small)), None, reference_prompts(4, 4), 4, 6)
    assert sum(m.confidence < threshold for m in measures) == 2
    err = capsys.readouterr().err
    assert "large share 25%" in err and "large share 50%" in err and "of always-large" in err
