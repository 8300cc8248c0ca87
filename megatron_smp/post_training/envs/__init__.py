"""Small RL environments shipped with the project (prompt generators and verifiable rewards)."""
