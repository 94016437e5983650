"""``python -m proxy.models {default,gemma}``: the bundled model's path."""

from __future__ import annotations

from proxy.models.bundled import main

raise SystemExit(main())
