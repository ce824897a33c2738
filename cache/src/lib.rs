//! The encoder-feature store: content-addressed vision features on disk (sled).
//! Empty until the vision work lands; the crate exists so the workspace layout is stable.
