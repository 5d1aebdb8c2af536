"""Deployment presets per flow (parameters, schedules, work pools); see ``prefect.yaml``.

The serve entry point and schedules arrive with the deployments issue; until then
``prefect.yaml`` lists one deployment per flow and ``tests/test_layout.py`` checks that every
entrypoint in it loads as a Prefect flow.
"""
