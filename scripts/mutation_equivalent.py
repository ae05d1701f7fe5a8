"""Survivors of ``scripts/mutation.py`` judged equivalent: no test can tell them from the original code.

``module -> {mutmut name: (the mutated line(s) as the report shows them, why it is equivalent)}``. The mutated text
is checked against the run, so after an edit renumbers a module's mutants a stale judgement is simply not applied.
"Equivalent" here includes mutants that differ only at a floating-point value no input reaches in practice (a bound
already widened by a 1e-12 slack); their reasons say so.
"""

from __future__ import annotations

EQUIVALENT: dict[str, dict[str, tuple[str, str]]] = {
    "promotion": {
        "citer.evaluation.promotion.x_objective__mutmut_13": (
            "if acc > rule.accuracy_ratio * float(ref) - 1e-12:",
            "> instead of >= against a bar already lowered by 1e-12: differs only at accuracy == ratio x reference - 1e-12 to the last bit",
        ),
        "citer.evaluation.promotion.x_objective__mutmut_25": (
            "if rel < rule.bytes_budget_rel_llm + 1e-12:",
            "< instead of <= against a budget already raised by 1e-12: differs only at bytes == budget + 1e-12 to the last bit",
        ),
        "citer.evaluation.promotion.x_choose_tau__mutmut_10": (
            "return best_row(rows, rule, method, )",
            "drops feasible_only=True, which is best_row's default",
        ),
        "citer.evaluation.promotion.x_paired_difference__mutmut_23": (
            "x, y = np.asarray(va, dtype=None), np.asarray(vb, dtype=np.float64)",
            "the other side stays float64, so the per-question difference is float64 whatever numpy makes of this side",
        ),
        "citer.evaluation.promotion.x_paired_difference__mutmut_25": (
            "x, y = np.asarray(va, ), np.asarray(vb, dtype=np.float64)",
            "the other side stays float64, so the per-question difference is float64 whatever numpy makes of this side",
        ),
        "citer.evaluation.promotion.x_paired_difference__mutmut_27": (
            "x, y = np.asarray(va, dtype=np.float64), np.asarray(vb, dtype=None)",
            "the other side stays float64, so the per-question difference is float64 whatever numpy makes of this side",
        ),
        "citer.evaluation.promotion.x_paired_difference__mutmut_29": (
            "x, y = np.asarray(va, dtype=np.float64), np.asarray(vb, )",
            "the other side stays float64, so the per-question difference is float64 whatever numpy makes of this side",
        ),
        "citer.evaluation.promotion.x__beats_llm__mutmut_8": (
            'return True, "XXXX"',
            "the text that comes with True is never read: decide_promotion uses it only when the candidate is not cheaper",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_20": (
            'what, better = ("bytes", -2.0) if champ_ok else ("accuracy", 1.0)',
            "a sign of 2 instead of 1 keeps every sign the decision reads; differs only for a difference within (5e-13, 1e-12]",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_23": (
            'what, better = ("bytes", -1.0) if champ_ok else ("accuracy", 2.0)',
            "a sign of 2 instead of 1 keeps every sign the decision reads; differs only for a difference within (5e-13, 1e-12]",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_29": (
            'what, better = ("accuracy", 2.0) if champ_ok else ("bytes", -1.0)',
            "a sign of 2 instead of 1 keeps every sign the decision reads; differs only for a difference within (5e-13, 1e-12]",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_33": (
            'what, better = ("accuracy", 1.0) if champ_ok else ("bytes", -2.0)',
            "a sign of 2 instead of 1 keeps every sign the decision reads; differs only for a difference within (5e-13, 1e-12]",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_46": (
            "wins = better * diff >= 1e-12 and (ci is None or min(better * ci[0], better * ci[1]) > 0.0)",
            ">= instead of > at the 1e-12 tolerance: differs only for a difference of exactly 1e-12",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_56": (
            "wins = better * diff > 1e-12 and (ci is None or min(better * ci[0], better / ci[1]) > 0.0)",
            "better is +1 or -1, and x / +-1 == x * +-1 exactly in floating point",
        ),
        "citer.evaluation.promotion.x__significant_win__mutmut_81": (
            "if not wins and better * diff >= 1e-12:",
            ">= instead of > at the 1e-12 tolerance: differs only for a difference of exactly 1e-12",
        ),
        "citer.evaluation.promotion.x_decide_promotion__mutmut_101": (
            "if cand_obj >= champ_obj and wins:",
            "equal objectives mean equal accuracy and bytes, so the paired difference is 0 and wins is already False",
        ),
    },
    "session": {
        "citer.decoding.session.xǁDecodeSessionǁ_note_logprobs__mutmut_45": (
            "k = max(self.rows[slots[i]].logprobs or 1 for i in want)",
            "k only bounds the top-k width: each row keeps its own first kk (0 here) of it, so a width of 1 instead of 0 adds nothing",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_note_logprobs__mutmut_57": (
            "top_v, top_i = lp.topk(min(k, lp.shape[+1]), dim=-1) if k else (None, None)",
            "lp is 2-d, so shape[+1] is shape[-1]",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_note_logprobs__mutmut_77": (
            "if top_i is not None and top_v is not None or kk",
            "with kk == 0 both branches give []: the slice [:0] of the top-k is empty, and top_i is None only when every kk is 0",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_choose__mutmut_30": (
            "out = [1] * len(rows)",
            "every slot of out is overwritten: each row is in exactly one sampling group",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_choose__mutmut_33": (
            "sel = torch.tensor(idx, dtype=None)",
            "torch.tensor of Python ints is int64 without a dtype too",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_choose__mutmut_56": (
            "for i, tok in zip(idx, toks, strict=False):",
            "idx and toks always have the same length (the sampler returns one token per row), so strict changes nothing",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_emit__mutmut_13": (
            "for s, llm in zip(slots, from_llm, strict=None):",
            "slots and from_llm are built from the same list, so strict changes nothing",
        ),
        "citer.decoding.session.xǁDecodeSessionǁ_retire__mutmut_27": (
            "self.hidden[dst.to(None)] = self.hidden[src.to(self.hidden.device)]",
            "Tensor.to(None) returns the tensor unchanged: the index stays on the device it is on",
        ),
    },
    "labels": {
        "citer.routing.labels.x_model_name__mutmut_5": (
            'return str(getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", ""))',
            'None and "" are both falsy: either way the config\'s name is taken next',
        ),
        "citer.routing.labels.x__decoder_hidden__mutmut_3": (
            "out = model.get_decoder()(input_ids=ids, attention_mask=None, use_cache=False)",
            "right padding: a causal model's real positions never attend to the pads after them, and positions count from 0 without a mask too",
        ),
        "citer.routing.labels.x__decoder_hidden__mutmut_7": (
            "out = model.get_decoder()(input_ids=ids, attention_mask=mask, )",
            "use_cache only decides whether a KV cache is also returned; only last_hidden_state is read",
        ),
        "citer.routing.labels.x_teacher_forced__mutmut_22": (
            'for s in progress(starts, desc="labels: teacher-forced", unit="batch"):',
            "total only sizes the progress bar",
        ),
        "citer.routing.labels.x_collect_iter1__mutmut_76": (
            "ok = work.rollouts(enc, branches, None, params.batch_size, params.max_new_tokens)",
            "None is as falsy as False for every LabelWork: SLM-only rollouts either way",
        ),
        "citer.routing.labels.x_collect_iter_k__mutmut_106": (
            'for e, p, t in zip(sel["example_id"], sel["position"], sel[col], )',
            "the three columns come from one DataFrame selection, so they always have the same length",
        ),
        "citer.routing.labels.x_collect_iter_k__mutmut_179": (
            'new[i] = _compare(None, llm_ok[i], int(tokens.at[i, "label"]))',
            "None is as falsy as False: _compare tests slm_ok for truth only",
        ),
    },
}
