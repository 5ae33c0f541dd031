"""Running a model within a RAM budget: the planner, the expert cache and its replacement policies,
the reader of the packed store, and the streaming of the trunk and the experts."""
