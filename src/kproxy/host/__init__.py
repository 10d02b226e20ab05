"""Host plumbing every mode shares: running host commands, entering network namespaces."""
