//! The cxx bridge. Every function returns `Result`: cxx catches the C++
//! exception and hands back its `what()` as the error message.

#[cxx::bridge(namespace = "mlxcel")]
pub(crate) mod bridge {
    unsafe extern "C++" {
        include!("mlxcel-mlx/include/shim.h");

        #[namespace = "mlx::core"]
        type array;
        type ArrayList;
        type TensorMap;

        fn from_f32(data: &[f32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn from_i32(data: &[i32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn from_u32(data: &[u32], shape: &[i32]) -> Result<UniquePtr<array>>;
        fn from_bytes(data: &[u8], shape: &[i32], dtype: i32) -> Result<UniquePtr<array>>;
        fn copy_bytes(a: &array, out: &mut [u8]) -> Result<()>;
        fn scalar_f32(v: f32) -> Result<UniquePtr<array>>;
        fn clone_array(a: &array) -> Result<UniquePtr<array>>;
        fn shape(a: &array) -> Result<Vec<i32>>;
        fn dtype_code(a: &array) -> Result<i32>;
        fn nbytes(a: &array) -> Result<usize>;
        fn buffer_bytes(a: &array) -> Result<usize>;
        fn to_f32_vec(a: &array) -> Result<Vec<f32>>;
        fn to_i32_vec(a: &array) -> Result<Vec<i32>>;
        fn to_u32_vec(a: &array) -> Result<Vec<u32>>;

        fn new_array_list() -> Result<UniquePtr<ArrayList>>;
        fn array_list_push(list: Pin<&mut ArrayList>, a: &array) -> Result<()>;
        fn array_list_len(list: &ArrayList) -> usize;
        fn array_list_get(list: &ArrayList, i: usize) -> Result<UniquePtr<array>>;
        fn eval_one(a: &array) -> Result<()>;
        fn eval_many(arrays: &ArrayList) -> Result<()>;
        fn async_eval_many(arrays: &ArrayList) -> Result<()>;

        fn astype(a: &array, dtype: i32) -> Result<UniquePtr<array>>;
        fn add(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn subtract(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn multiply(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn divide(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn minimum(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn swiglu(gate: &array, up: &array) -> Result<UniquePtr<array>>;
        fn geglu_tanh(gate: &array, up: &array) -> Result<UniquePtr<array>>;
        fn clamped_swiglu(
            gate: &array,
            up: &array,
            gate_bias: &array,
            up_bias: &array,
            alpha: f32,
            limit: f32,
        ) -> Result<UniquePtr<array>>;
        fn maximum(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn sigmoid(a: &array) -> Result<UniquePtr<array>>;
        fn tanh(a: &array) -> Result<UniquePtr<array>>;
        fn matmul(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn reshape(a: &array, shape: &[i32]) -> Result<UniquePtr<array>>;
        fn transpose(a: &array, axes: &[i32]) -> Result<UniquePtr<array>>;
        fn contiguous(a: &array) -> Result<UniquePtr<array>>;
        fn softmax(a: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn argmax(a: &array, axis: i32, keepdims: bool) -> Result<UniquePtr<array>>;
        fn take(a: &array, indices: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn take_along_axis(a: &array, indices: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn argpartition(a: &array, kth: i32, axis: i32) -> Result<UniquePtr<array>>;
        fn argsort(a: &array, axis: i32) -> Result<UniquePtr<array>>;
        fn sum_axis(a: &array, axis: i32, keepdims: bool) -> Result<UniquePtr<array>>;
        fn floor_divide(a: &array, b: &array) -> Result<UniquePtr<array>>;
        fn gather_mm(
            a: &array,
            b: &array,
            rhs_indices: &array,
            sorted: bool,
        ) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn gather_qmm(
            x: &array,
            w: &array,
            scales: &array,
            biases: &array,
            rhs_indices: &array,
            group_size: i32,
            bits: i32,
            sorted: bool,
        ) -> Result<UniquePtr<array>>;
        fn put_along_axis(
            a: &array,
            indices: &array,
            values: &array,
            axis: i32,
        ) -> Result<UniquePtr<array>>;
        fn concatenate(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<array>>;
        fn slice(a: &array, start: &[i32], stop: &[i32]) -> Result<UniquePtr<array>>;
        fn slice_update(
            src: &array,
            update: &array,
            start: &[i32],
            stop: &[i32],
        ) -> Result<UniquePtr<array>>;
        fn zeros(shape: &[i32], dtype: i32) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn quantized_matmul(
            x: &array,
            w: &array,
            scales: &array,
            biases: &array,
            transpose: bool,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<array>>;
        fn quantize(w: &array, group_size: i32, bits: i32) -> Result<UniquePtr<ArrayList>>;
        fn dequantize(
            w: &array,
            scales: &array,
            biases: &array,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<array>>;

        fn linalg_inv(a: &array) -> Result<UniquePtr<array>>;

        fn rms_norm(x: &array, weight: &array, eps: f32) -> Result<UniquePtr<array>>;
        fn depthwise_conv1d(x: &array, weight: &array) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn gated_delta(
            q: &array,
            k: &array,
            v: &array,
            a: &array,
            b: &array,
            a_log: &array,
            dt_bias: &array,
            state: &array,
        ) -> Result<UniquePtr<ArrayList>>;
        #[allow(clippy::too_many_arguments)]
        fn ssm_scan(
            x: &array,
            dt: &array,
            b: &array,
            c: &array,
            a_log: &array,
            d: &array,
            dt_bias: &array,
            dt_min: f32,
            dt_max: f32,
            state: &array,
        ) -> Result<UniquePtr<ArrayList>>;
        fn gated_rms_norm(
            x: &array,
            gate: &array,
            weight: &array,
            eps: f32,
        ) -> Result<UniquePtr<array>>;
        fn rope(
            x: &array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: i32,
        ) -> Result<UniquePtr<array>>;
        fn rope_positions(
            x: &array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offsets: &array,
        ) -> Result<UniquePtr<array>>;
        fn rope_freqs_positions(
            x: &array,
            dims: i32,
            traditional: bool,
            scale: f32,
            offsets: &array,
            freqs: &array,
        ) -> Result<UniquePtr<array>>;
        fn rope_freqs(
            x: &array,
            dims: i32,
            traditional: bool,
            scale: f32,
            offset: i32,
            freqs: &array,
        ) -> Result<UniquePtr<array>>;
        fn sdpa(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask_mode: &str,
        ) -> Result<UniquePtr<array>>;
        fn sdpa_masked(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask: &array,
        ) -> Result<UniquePtr<array>>;
        fn sdpa_sinks(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask_mode: &str,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;
        fn sdpa_masked_sinks(
            q: &array,
            k: &array,
            v: &array,
            scale: f32,
            mask: &array,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;

        fn load_safetensors(path: &str) -> Result<UniquePtr<TensorMap>>;
        fn load_gguf_tensors(path: &str) -> Result<UniquePtr<TensorMap>>;
        fn tensor_names(m: &TensorMap) -> Result<Vec<String>>;
        fn tensor_take(m: Pin<&mut TensorMap>, name: &str) -> Result<UniquePtr<array>>;
        fn save_safetensors(path: &str, names: &[String], arrays: &ArrayList) -> Result<()>;

        fn gemv_forwarding_active() -> Result<bool>;
        fn skinny_max_rows() -> Result<i32>;
        fn gpu_available() -> Result<bool>;
        fn set_cudnn_attention(enabled: bool) -> Result<()>;
        fn set_kernel_cache_dir(dir: &str) -> Result<()>;
        #[allow(clippy::too_many_arguments)]
        fn paged_decode_attention(
            q: &array,
            k_pool: &array,
            v_pool: &array,
            tables: &array,
            meta: &array,
            scale: &array,
            block_size: i32,
            window: i32,
        ) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn paged_decode_attention_sinks(
            q: &array,
            k_pool: &array,
            v_pool: &array,
            tables: &array,
            meta: &array,
            scale: &array,
            block_size: i32,
            window: i32,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn paged_decode_attention_quantized(
            q: &array,
            k_pool: &array,
            k_scales: &array,
            k_biases: &array,
            v_pool: &array,
            v_scales: &array,
            v_biases: &array,
            tables: &array,
            meta: &array,
            scale: &array,
            block_size: i32,
            window: i32,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<array>>;
        #[allow(clippy::too_many_arguments)]
        fn paged_decode_attention_quantized_sinks(
            q: &array,
            k_pool: &array,
            k_scales: &array,
            k_biases: &array,
            v_pool: &array,
            v_scales: &array,
            v_biases: &array,
            tables: &array,
            meta: &array,
            scale: &array,
            block_size: i32,
            window: i32,
            group_size: i32,
            bits: i32,
            sinks: &array,
        ) -> Result<UniquePtr<array>>;
        fn paged_attention_available() -> Result<bool>;
        fn set_paged_attention_split(split: bool);
        fn use_device(gpu: bool) -> Result<()>;
        fn default_device_is_gpu() -> Result<bool>;
        fn version() -> Result<String>;
        fn device_name(gpu: bool) -> Result<String>;
    }

    unsafe extern "C++" {
        include!("mlxcel-mlx/include/distributed.h");

        type DistGroup;

        fn distributed_is_available(backend: &str) -> Result<bool>;
        fn distributed_init(backend: &str, strict: bool) -> Result<UniquePtr<DistGroup>>;
        fn group_rank(g: &DistGroup) -> Result<i32>;
        fn group_size(g: &DistGroup) -> Result<i32>;
        fn dist_all_sum(x: &array, g: &DistGroup) -> Result<UniquePtr<array>>;
        fn dist_all_gather(x: &array, g: &DistGroup) -> Result<UniquePtr<array>>;
        fn dist_send(x: &array, dst: i32, g: &DistGroup) -> Result<UniquePtr<array>>;
        fn dist_recv_like(like: &array, src: i32, g: &DistGroup) -> Result<UniquePtr<array>>;
    }
}
