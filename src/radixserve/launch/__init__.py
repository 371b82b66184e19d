"""The launchers: the ``radixserve`` CLI (``cli``) and the local stack (``local_stack``); they import the wings."""
