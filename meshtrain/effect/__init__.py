"""Settings that count only while a feature is on: one table (`NEEDS`, in
`meshtrain.effect.table`) of `Needs` rows (`meshtrain.effect.needs`), read by the run check
(`no_effect_problems`) and by ``meshtrain train`` (`job_problems`); what the rows read off a
run is `meshtrain.effect.features`."""

from meshtrain.effect.needs import Needs
from meshtrain.effect.table import NEEDS, job_problems, no_effect_problems

__all__ = ["NEEDS", "Needs", "job_problems", "no_effect_problems"]
