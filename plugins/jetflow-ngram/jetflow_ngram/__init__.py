"""A training-free jetflow drafter: prompt lookup that drafts trees, installed as a plugin."""
