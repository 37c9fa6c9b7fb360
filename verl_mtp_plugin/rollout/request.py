"""What verl's rollout asks vLLM for: token ids and, when verl wants them, each token's log-probability, nothing
more.

verl 0.9.1's vLLM server (``vLLMHttpServer.generate``) builds each request's ``SamplingParams`` from the agent
loop's dict and returns only the token ids and the sampled tokens' log-probabilities (``TokenOutput``); vLLM's
defaults make its front end, one Python process per replica, also detokenize every generated token (the text, and
one ``tokenizer.decode`` per log-probability for the decoded token beside it) and keep one ``dict`` and one
``Logprob`` object per token. Measured in vLLM's engine alone (``benchmarks/RESULTS.md``, "The plugin's lean rollout
requests"), that was most of what the log-probabilities cost the front end; in verl's trainer on the GPU the front
end outlasted vLLM's engine core while the rollout's tokens flowed.

:func:`lean_request` is the rule (pure, no vLLM import): ``detokenize=False`` and ``flat_logprobs=True`` (vLLM's
``FlatLogprobs``: a few flat lists per request, read the same way) unless the request set either itself or needs
what they drop: stop strings need the text; prompt log-probabilities keep vLLM's default container. The plugin's
vLLM server applies it to every request (:mod:`verl_mtp_plugin.rollout.replica`).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["LEAN_LINE", "lean_request"]

#: Printed once by each of the plugin's vLLM servers, at its first lean request (the run's log shows it).
LEAN_LINE = ("verl_mtp_plugin: vLLM rollout requests ask for token ids and log-probabilities only "
             "(detokenize=False, flat_logprobs={flat})")


def lean_request(sampling_params: Mapping[str, Any], *, flat_supported: bool = True) -> dict[str, Any]:
    """A copy of verl's ``sampling_params`` dict for ``vLLMHttpServer.generate`` with ``detokenize=False`` and
    ``flat_logprobs=True`` added where nothing in the request needs vLLM's defaults.

    * ``detokenize`` stays as the request set it; unset, it is False unless the request has stop strings
      (``stop``: vLLM matches them on the text and refuses them without detokenization).
    * ``flat_logprobs`` stays as the request set it; unset, it is True when vLLM has it (``flat_supported``) and
      the request asks for no prompt log-probabilities (``prompt_logprobs``: verl's reader of those walks vLLM's
      default per-position dicts).
    """
    out = dict(sampling_params)
    if "detokenize" not in out and not out.get("stop"):
        out["detokenize"] = False
    if "flat_logprobs" not in out and flat_supported and out.get("prompt_logprobs") is None:
        out["flat_logprobs"] = True
    return out
