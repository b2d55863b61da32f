"""What is done with an audit or a model beyond the audit's own steps: compare a serving
engine's routing trace with the model's own (:mod:`.routes`), fold a static profile the
audit measured into the model (:mod:`.fold`), score benchmark tasks under its conditions
(:mod:`.harness`: the harness's model class, also used inside an audit run with
``--lm-eval-tasks``; :mod:`.tasks`: on a finished audit)."""
