//! A statement both backends run, and a result row both read: the pieces the shared
//! queries (`queries.rs`) are written in, free of either client. Each backend binds
//! a [`Value`] and reads a [`Row`] with its own client (`sqlite.rs`, `postgres/`).
//!
//! The text is written once, in Postgres's placeholder form (`$1`). SQLite runs it with
//! `?` for `$` ([`Stmt::sqlite_text`]): `?1` is SQLite's numbered placeholder, while a
//! `$1` there would be a *named* one, numbered by first appearance rather than by its
//! digits.

use std::borrow::Cow;

use super::StoreError;

/// One value bound to a placeholder. Every column the shared statements bind is an
/// integer (BIGINT in Postgres) or text, either possibly NULL.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Int(Option<i64>),
    Text(Option<Cow<'a, str>>),
}

impl From<i64> for Value<'_> {
    fn from(v: i64) -> Self {
        Value::Int(Some(v))
    }
}

impl From<Option<i64>> for Value<'_> {
    fn from(v: Option<i64>) -> Self {
        Value::Int(v)
    }
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(v: &'a str) -> Self {
        Value::Text(Some(Cow::Borrowed(v)))
    }
}

impl<'a> From<&'a String> for Value<'a> {
    fn from(v: &'a String) -> Self {
        Value::Text(Some(Cow::Borrowed(v)))
    }
}

impl<'a> From<Option<&'a str>> for Value<'a> {
    fn from(v: Option<&'a str>) -> Self {
        Value::Text(v.map(Cow::Borrowed))
    }
}

impl From<String> for Value<'_> {
    fn from(v: String) -> Self {
        Value::Text(Some(Cow::Owned(v)))
    }
}

impl Value<'_> {
    fn into_owned(self) -> Value<'static> {
        match self {
            Value::Int(v) => Value::Int(v),
            Value::Text(v) => Value::Text(v.map(|t| Cow::Owned(t.into_owned()))),
        }
    }
}

/// A statement's text (placeholders `$1`, `$2`, ... as [`Stmt::values`] are ordered) and
/// the values bound to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stmt<'a> {
    pub sql: &'static str,
    pub values: Vec<Value<'a>>,
}

impl<'a> Stmt<'a> {
    pub fn new(sql: &'static str, values: Vec<Value<'a>>) -> Stmt<'a> {
        Stmt { sql, values }
    }

    /// The statement owning its values, for a backend that runs it on another thread.
    pub fn into_owned(self) -> Stmt<'static> {
        Stmt {
            sql: self.sql,
            values: self.values.into_iter().map(Value::into_owned).collect(),
        }
    }

    /// The text with SQLite's numbered placeholders (`?1` for `$1`). No shared
    /// statement has a `$` of its own.
    pub fn sqlite_text(&self) -> String {
        self.sql.replace('$', "?")
    }
}

/// A result row, read by column index the same way from either client.
pub trait Row {
    fn int(&self, i: usize) -> Result<i64, StoreError>;
    fn opt_int(&self, i: usize) -> Result<Option<i64>, StoreError>;
    fn text(&self, i: usize) -> Result<String, StoreError>;
    fn opt_text(&self, i: usize) -> Result<Option<String>, StoreError>;
}

/// A query and how each of its rows reads.
pub struct Query<'a, T> {
    pub stmt: Stmt<'a>,
    pub read: fn(&dyn Row) -> Result<T, StoreError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_text_numbers_placeholders_as_postgres_does() {
        let s = Stmt::new("UPDATE t SET a = $2 WHERE id = $1", vec![]);
        assert_eq!(s.sqlite_text(), "UPDATE t SET a = ?2 WHERE id = ?1");
    }
}
