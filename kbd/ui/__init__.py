"""``kbd ui``: the Knowledge page (docs/knowledge-page.md), a local web server for one principal.

:mod:`kbd.ui.security` decides what the web surface lets through (pure);
:mod:`kbd.ui.server` serves the page's assets and its JSON API, every route one
:class:`kbd.ops.Op` run through the CLI's backend (directly on the root,
or through the daemon) as the principal resolved at start-up. The assets in
``kbd/ui/assets/`` ship in the wheel as package data.
"""
