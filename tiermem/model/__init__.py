"""TieredModel, its construction from validated options, and what it hands users (report, resident block, torch optimizer face)."""
