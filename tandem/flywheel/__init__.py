"""The serve-to-train flywheel: traces -> buffer -> online trainer -> versioned weights -> hot-swap."""
