//! Python classes that wrap a core value (`PyEngineStats(EngineStats)`): their read-only
//! properties read the core value's fields, so the struct is written once, in the core.

/// `field_getters! { PyType { /// doc \n field: Type, ... } }`: a `#[getter]` per field of
/// the wrapped value `self.0`, with the doc text as the property's docstring.
macro_rules! field_getters {
    ($class:ident { $($(#[doc = $doc:expr])* $name:ident: $ty:ty,)* }) => {
        #[pymethods]
        impl $class {
            $(
                $(#[doc = $doc])*
                #[getter]
                fn $name(&self) -> $ty {
                    self.0.$name
                }
            )*
        }
    };
}

pub(crate) use field_getters;
