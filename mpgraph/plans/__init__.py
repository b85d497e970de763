"""The Plan: the record of every decision, its JSON form, and diffs between plans."""
