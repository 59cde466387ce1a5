//! Which OpenAI route a request came in on: its upstream path, and its name in cache keys.

/// The OpenAI routes the gateway forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
    Embeddings,
}

impl Route {
    /// Index into [`crate::config::ROUTE_PATHS`] and
    /// [`crate::config::ResolvedUpstream::route_urls`].
    pub(crate) fn index(self) -> usize {
        match self {
            Route::Chat => 0,
            Route::Completions => 1,
            Route::Embeddings => 2,
        }
    }

    pub fn path(self) -> &'static str {
        crate::config::ROUTE_PATHS[self.index()]
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
        }
    }
}
