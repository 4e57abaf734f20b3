"""Hot recovery: survivors re-run the script in place and a replacement joins from peer memory."""
