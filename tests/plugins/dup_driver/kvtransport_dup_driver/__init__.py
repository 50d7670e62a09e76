"""Never imported: the registry refuses a duplicated name before loading it."""
